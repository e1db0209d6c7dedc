"""Real OpenVLA / OpenVLA-OFT checkpoints (local HF directories, their Prismatic remote code) behind the ``VLAPolicy``
interface: OpenVLA's prompt, the checkpoint's image processor, logits at the action-token ids divided by the
temperature, ``openvla`` autoregressive with the KV cache, ``openvla_oft`` one bidirectional pass of exactly
``chunk_size * action_dim`` positions. Checkpoints GRPO cannot train are refused before loading, naming the fix.
Details: docs/FIDELITY.md "Loading OpenVLA / OpenVLA-OFT checkpoints"."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from async_vla.image_ops import center_crop_resize
from async_vla.policy.interface import ArrayLike, VLAPolicy, sample_tokens
from async_vla.policy.prismatic import (
    STATISTICS_FILE, check_action_positions, drop_lm_labels, ensure_robot_platform, load_dataset_statistics,
    make_bidirectional, resolve_unnorm_key,
)
from async_vla.tokenizer import ActionStats, ActionTokenizer
from async_vla.vla_checkpoint import FORWARDS, require_trainable

if TYPE_CHECKING:
    from async_vla.config import PolicyConfig

log = logging.getLogger(__name__)

EMPTY_TOKEN = 29871  # OpenVLA appends this "empty" token after the prompt before the action tokens
PROMPT = "In: What action should the robot take to {}?\nOut:"


def _auto_model_class():
    import transformers

    cls = getattr(transformers, "AutoModelForVision2Seq", None)
    return cls if cls is not None else transformers.AutoModelForImageTextToText


def _dtype_kwarg() -> str:
    """``from_pretrained``'s name for the weights' dtype: ``dtype`` from transformers 4.56 (``torch_dtype`` is
    deprecated there), ``torch_dtype`` before (what OpenVLA's own remote code was written against: 4.40)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _stats_from_checkpoint(model, action_dim: int) -> dict[str, ActionStats]:
    norm_stats = getattr(model, "norm_stats", None) or getattr(getattr(model, "config", None), "norm_stats", None) or {}
    out = {}
    for key, entry in norm_stats.items():
        act = entry.get("action", entry)
        if "q01" not in act or "q99" not in act:
            continue
        mask = act.get("mask", [True] * len(act["q01"]))   # modeling_prismatic.py _unnormalize_actions: ones
        out[key] = ActionStats(act["q01"], act["q99"], mask)
    return out


class OpenVLAPolicy(VLAPolicy):
    """A Prismatic OpenVLA(-OFT) model with action logits restricted to the 256 action ids. ``forward`` is its remote
    code's contract (async_vla/vla_checkpoint.py; default: the arch's first, SimpleVLA-RL's for OFT)."""

    def __init__(self, model, processor, policy_cfg: "PolicyConfig", forward: Optional[str] = None):
        super().__init__()
        self.model = model
        self.processor = processor
        self.policy_cfg = policy_cfg
        self.decoding = "parallel" if policy_cfg.arch == "openvla_oft" else "autoregressive"
        self.forward_contract = forward or FORWARDS[policy_cfg.arch][0]
        if self.forward_contract not in FORWARDS[policy_cfg.arch]:
            raise ValueError(f"policy.arch={policy_cfg.arch} runs a {' or '.join(FORWARDS[policy_cfg.arch])} forward, "
                             f"not {self.forward_contract}")
        if self.forward_contract == "oft_labels":
            module = sys.modules[type(model).__module__]
            missing = [n for n in ("_prepare_input_for_action_prediction", "_prepare_labels_for_action_prediction")
                       if not hasattr(model, n)] + ([] if hasattr(module, "IGNORE_INDEX") else ["IGNORE_INDEX"])
            if missing:
                raise ValueError(f"openvla-oft's forward contract needs the remote code's {missing}")
            self._ignore_index = int(module.IGNORE_INDEX)
            drop_lm_labels(model.language_model)
        stats = _stats_from_checkpoint(model, policy_cfg.action_dim)
        key = resolve_unnorm_key(policy_cfg.unnorm_key, stats)
        if key is None and len(stats) > 1:
            raise ValueError(f"checkpoint has action statistics {sorted(stats)}: choose one with policy.unnorm_key")
        if key is not None and key not in stats:
            raise ValueError(f"policy.unnorm_key={key!r} not in the checkpoint's statistics {sorted(stats)}")
        self.tokenizer = ActionTokenizer(vocab_size=policy_cfg.vocab_size, num_bins=policy_cfg.num_bins,
                                         chunk_size=policy_cfg.chunk_size, action_dim=policy_cfg.action_dim,
                                         stats=stats, unnorm_key=key)
        self.tokens_per_call = policy_cfg.chunk_size * policy_cfg.action_dim
        self._lo = self.tokenizer.first_action_id
        self._hi = self.tokenizer.vocab_size
        if self.decoding == "parallel":
            lm = getattr(model, "language_model", None)
            if lm is None:
                raise ValueError(f"policy.arch=openvla_oft: {type(model).__name__} has no `language_model` (the "
                                 "Prismatic layout: vision_backbone, projector, language_model)")
            make_bidirectional(lm)      # OpenVLA-OFT's LM attends both ways (its transformers fork: is_causal=False)

    def save_pretrained(self, directory) -> None:
        """A checkpoint directory like the one loaded (config, safetensors weights, remote code, processor), so
        ``policy.path`` / bin/eval take it as they took the original."""
        self.model.save_pretrained(str(directory))
        self.processor.save_pretrained(str(directory))
        norm_stats = getattr(self.model, "norm_stats", None)
        if norm_stats:     # they may have come from dataset_statistics.json, which then wins on reload: keep it
            (Path(directory) / STATISTICS_FILE).write_text(json.dumps(norm_stats, indent=2))

    # ---- inputs ---------------------------------------------------------------------------------------
    def _prompt_ids(self, instruction: str) -> Tensor:
        ids = self.processor.tokenizer(PROMPT.format(instruction.lower()), return_tensors="pt").input_ids[0]
        if int(ids[-1]) != EMPTY_TOKEN:
            ids = torch.cat([ids, torch.tensor([EMPTY_TOKEN])])
        return ids.to(self.device)

    def _pixels(self, images: ArrayLike) -> Tensor:
        from PIL import Image

        arr = images.cpu().numpy() if isinstance(images, Tensor) else np.asarray(images)
        if self.policy_cfg.center_crop:
            arr = [center_crop_resize(np.asarray(a, dtype=np.uint8)) for a in arr]
        pil = [Image.fromarray(np.ascontiguousarray(a, dtype=np.uint8)) for a in arr]
        pix = self.processor.image_processor(pil, return_tensors="pt")["pixel_values"]
        return pix.to(self.device, dtype=next(self.model.parameters()).dtype)

    def _groups(self, instructions: Sequence[str]) -> dict[str, list[int]]:
        # Rows with one instruction share a prompt length, so each group runs without padding.
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(instructions):
            groups.setdefault(s, []).append(i)
        return groups

    def _logits(self, out) -> Tensor:
        logits = out if isinstance(out, Tensor) else out.logits
        return logits[..., self._lo:self._hi].float()

    # ---- interface ------------------------------------------------------------------------------------
    def action_logits(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                      action_tokens: Optional[Tensor]) -> Tensor:
        t = self.tokens_per_call
        pixels = self._pixels(images)
        result = torch.empty(len(instructions), t, self.tokenizer.num_bins, device=self.device)
        for instr, rows in self._groups(instructions).items():
            ids = self._prompt_ids(instr).unsqueeze(0).expand(len(rows), -1)
            if self.decoding == "autoregressive":
                if action_tokens is None:
                    raise ValueError("autoregressive decoding needs the action tokens to teacher-force on")
                prev = action_tokens[rows, :-1].to(self.device) + self._lo  # bin indices -> token ids
                ids = torch.cat([ids, prev], dim=1)
            if self.decoding == "parallel":
                result[rows] = self._logits(self._oft_action_logits(ids, pixels[rows]))
                continue
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels[rows],
                             use_cache=False)
            result[rows] = self._logits(out)[:, -t:]
        return result

    def _oft_action_logits(self, ids: Tensor, pixels: Tensor) -> Tensor:
        """``[B, chunk x dim, vocab]``: the logits of the action positions of one parallel OFT pass."""
        mask = torch.ones_like(ids)
        if self.forward_contract == "oft_logits":
            # SimpleVLA-RL's OFT forward (dp_rob.py and rob_rollout.py call it with these three arguments)
            out = self.model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
            logits = out if isinstance(out, Tensor) else out.logits
        else:
            # openvla-oft's forward, given what its predict_action builds with the model's own helpers: placeholders
            # and the stop token appended, labels marking them. Its logits span [BOS, patches, prompt, placeholders,
            # stop]; the action logits are those of the positions before each placeholder (predict_action's slice
            # from NUM_PATCHES + NUM_PROMPT_TOKENS), counted here from the end.
            ids_ext, mask_ext = self.model._prepare_input_for_action_prediction(ids, mask)
            labels = self.model._prepare_labels_for_action_prediction(torch.full_like(ids, self._ignore_index), ids_ext)
            out = self.model(input_ids=ids_ext, attention_mask=mask_ext, pixel_values=pixels, labels=labels)
            n = ids_ext.shape[1] - ids.shape[1] - 1           # placeholders appended, by the remote code's constants
            logits = out.logits[:, -n - 2:-2]
        check_action_positions(logits, self.policy_cfg.chunk_size, self.policy_cfg.action_dim)
        return logits

    def _sample(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str], temperature: float,
                generator: Optional[torch.Generator], greedy: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        if self.decoding == "parallel":
            return sample_tokens(self.action_logits(images, proprio, instructions, None), temperature, generator,
                                 greedy)
        pixels = self._pixels(images)
        b, t = len(instructions), self.tokens_per_call
        idx_all = torch.empty(b, t, dtype=torch.long, device=self.device)
        logp_all = torch.empty(b, t, device=self.device)
        for instr, rows in self._groups(instructions).items():
            ids = self._prompt_ids(instr).unsqueeze(0).expand(len(rows), -1)
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels[rows],
                             use_cache=True)
            for i in range(t):
                idx, logp = sample_tokens(self._logits(out)[:, -1], temperature, generator,
                                          None if greedy is None else greedy[i])
                idx_all[rows, i], logp_all[rows, i] = idx, logp
                if i + 1 == t:
                    break
                out = self.model(input_ids=(idx + self._lo).unsqueeze(1), past_key_values=out.past_key_values,
                                 use_cache=True)
        return idx_all, logp_all


def use_sdpa(lm) -> None:
    """Switch a loaded (eager-built) language model to PyTorch SDPA attention (transformers picks the kernel per
    call from the config); a transformers without ``set_attn_implementation`` keeps eager, saying so."""
    if lm is None:
        return
    if hasattr(lm, "set_attn_implementation"):
        lm.set_attn_implementation("sdpa")
    else:
        log.warning("transformers %s cannot switch the language model to SDPA after loading: it runs eager attention",
                    __import__("transformers").__version__)


def load_openvla_policy(policy_cfg: "PolicyConfig", device: Optional[str] = None,
                        dtype: Optional[torch.dtype] = None) -> OpenVLAPolicy:
    """Load ``policy_cfg.path`` (a local OpenVLA / OpenVLA-OFT HF directory) onto ``device`` in ``dtype`` (default: the
    current GPU in bf16, else the CPU in fp32; a ZeRO-3 learner rank loads onto the CPU to partition it)."""
    from transformers import AutoProcessor

    if policy_cfg.path is None:
        raise ValueError(f"policy.arch={policy_cfg.arch} needs policy.path (a local checkpoint directory)")
    if policy_cfg.arch == "openvla" and policy_cfg.chunk_size != 1:
        raise ValueError("policy.arch=openvla predicts one step (7 tokens) per call: set policy.chunk_size=1")
    flavour = require_trainable(policy_cfg.path, policy_cfg.arch)   # what preflight refuses, refused here too
    if policy_cfg.arch == "openvla_oft":
        ensure_robot_platform(policy_cfg.chunk_size, policy_cfg.action_dim)   # before the remote code is imported
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    # attn_implementation="eager" at construction: Prismatic's `_supports_sdpa` is a property that reads
    # self.language_model, which transformers >= 4.5x asks for in PreTrainedModel.__init__, before the remote code
    # has built it (AttributeError on SimpleVLA-RL's modeling_prismatic.py under 4.57.6, checked on CPU). The
    # language model then runs SDPA, the default it was trained with (transformers 4.40).
    model = _auto_model_class().from_pretrained(policy_cfg.path, trust_remote_code=True, low_cpu_mem_usage=True,
                                                attn_implementation="eager", **{_dtype_kwarg(): dtype}).to(device)
    model.eval()
    use_sdpa(getattr(model, "language_model", None))
    statistics = load_dataset_statistics(policy_cfg.path)
    if statistics is not None:     # fsdp_workers.py: the file's statistics replace the config's norm_stats
        model.norm_stats = statistics
    processor = AutoProcessor.from_pretrained(policy_cfg.path, trust_remote_code=True)
    return OpenVLAPolicy(model, processor, policy_cfg, flavour.forward)
