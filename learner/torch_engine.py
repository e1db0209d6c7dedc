"""``TorchLearner``: the single-process learner with torch AdamW (serial mode, tests, debugging)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor

from async_vla.batching import TrainBatch
from async_vla.config import Config
from async_vla.phases import PhaseClock
from learner.checkpoint_files import capture_rng_state, optimizer_tensors, restore_rng_state, tensors_digest
from learner.checkpoint_names import LATEST_FILE, checkpoint_tag, latest_tag, prune_checkpoints
from learner.core import Learner, frozen_copy, policy_has_entropy, save_policy_dir


class TorchLearner(Learner):
    """Single-process learner with torch AdamW (serial mode, tests, debugging). fp32, or bf16 autocast on
    a GPU when ``learner.precision`` is bf16 / auto."""

    def __init__(self, cfg: Config, policy: torch.nn.Module, device: Optional[str | torch.device] = None,
                 phases: Optional[PhaseClock] = None):
        super().__init__(cfg, policy, phases=phases)
        self._device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.policy.to(self._device)
        # eval(): no dropout, so the learner's log-probs match the actors' at equal weights.
        self.policy.eval()
        lc = cfg.learner
        self._params = [p for p in self.policy.parameters() if p.requires_grad]
        self.ref_policy = frozen_copy(self.policy) if self.uses_reference else None
        self.optimizer = torch.optim.AdamW(self._params, lr=lc.lr, betas=tuple(lc.betas),
                                           weight_decay=lc.weight_decay)
        self._bf16 = self._device.type == "cuda" and lc.precision in ("auto", "bf16")
        self._has_entropy = policy_has_entropy(policy)

    @property
    def device(self) -> torch.device:
        return self._device

    def _logprobs(self, mb: TrainBatch, policy: Optional[torch.nn.Module] = None) -> Tensor:
        with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self._bf16):
            return (policy or self.policy).token_logprobs(mb.images, mb.proprio, mb.instructions, mb.action_tokens,
                                                          self.temperature)

    def _logprobs_entropy(self, mb: TrainBatch) -> tuple[Tensor, Optional[Tensor]]:
        if not self._has_entropy:
            return self._logprobs(mb), None
        with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self._bf16):
            return self.policy.token_logprobs_entropy(mb.images, mb.proprio, mb.instructions, mb.action_tokens,
                                                      self.temperature)

    def _ref_logprobs(self, mb: TrainBatch) -> Tensor:
        return self._logprobs(mb, self.ref_policy)

    def _backward(self, loss: Tensor, finite: bool) -> None:
        if finite:  # a non-finite loss skips the step anyway: no point in its gradient
            loss.backward()

    def _optimizer_step(self, nonfinite_loss: bool) -> tuple[bool, float]:
        if nonfinite_loss:
            self.optimizer.zero_grad(set_to_none=True)
            return False, float("nan")
        grads = [p.grad for p in self._params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not torch.isfinite(norm):  # checked BEFORE step: AdamW would spread a NaN into every moment
            self.optimizer.zero_grad(set_to_none=True)
            return False, float(norm)
        torch.nn.utils.clip_grads_with_norm_(self._params, self.cfg.learner.grad_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True, float(norm)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def full_state_items(self, all_ranks: bool = False, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
        from learner.adapt import merge_lora_items

        items = ((name, p.detach().clone() if copy else p.detach()) for name, p in self.policy.named_parameters())
        yield from merge_lora_items(items, self.lora_scale)

    def optimizer_digest(self) -> str:
        return tensors_digest(optimizer_tensors(self.optimizer))

    def save_checkpoint(self, directory: str | Path, extra: Optional[dict] = None) -> Path:
        """``<dir>/v<version>/learner.pt`` (+ ``<dir>/latest``), written via a temp dir then renamed."""
        directory = Path(directory)
        tag = checkpoint_tag(self.version)
        final, tmp = directory / tag, directory / (tag + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save({"learner": self._learner_state(extra), "policy": self.policy.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "rng": capture_rng_state(),
                    "streams": self._rank_streams()}, tmp / "learner.pt")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (directory / (LATEST_FILE + ".tmp")).write_text(tag)
        (directory / (LATEST_FILE + ".tmp")).replace(directory / LATEST_FILE)
        prune_checkpoints(directory, self.cfg.learner.keep_checkpoints)
        return final

    def load_checkpoint(self, directory: str | Path, tag: Optional[str] = None) -> dict:
        directory = Path(directory)
        tag = tag or latest_tag(directory)
        if tag is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        state = torch.load(directory / tag / "learner.pt", map_location=self._device, weights_only=False)
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        self._restore_rank_streams(state.get("streams", state))   # (before "streams": the generator at top level)
        return self._restore_learner_state(state["learner"])

    def export_policy(self, directory: str | Path) -> Optional[Path]:
        from learner.adapt import merged_view

        with merged_view(self.policy, self.lora_scale):
            return save_policy_dir(self.policy, Path(directory))
