"""The policy interface shared by actors and learner (docs/CONTRACTS.md) and the factory functions.

Every policy produces logits over the ``num_bins`` action tokens only (ids ``vocab - num_bins .. vocab - 1``).
Behaviour log-probs (``act``) and learner log-probs (``token_logprobs``) are both
``log_softmax(action_logits / T)`` gathered at the chosen tokens, computed by the same code path, so they agree
to float rounding for the same weights. Temperature 0 means greedy; its log-probs are reported at T = 1.
"""

from __future__ import annotations

import abc
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from async_vla.tokenizer import ActionStats, ActionTokenizer

if TYPE_CHECKING:
    from async_vla.config import Config, PolicyConfig

ArrayLike = Union[np.ndarray, Tensor]
CONFIG_FILE = "async_vla_policy.json"
WEIGHTS_FILE = "model.safetensors"
VERSION_FILE = "async_vla_version.json"    # the policy version a saved directory holds (the learner's final export)
FORMAT_VERSION = 1


def write_policy_version(directory: Union[str, Path], version: int) -> None:
    """Record which policy version a saved policy directory holds (``VERSION_FILE``; the learner's final export)."""
    (Path(directory) / VERSION_FILE).write_text(json.dumps({"version": int(version)}) + "\n")


def read_policy_version(directory: Union[str, Path]) -> Optional[int]:
    """The version ``write_policy_version`` recorded, or None (not recorded, unreadable)."""
    try:
        return int(json.loads((Path(directory) / VERSION_FILE).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def effective_temperature(temperature: float) -> float:
    """Temperature used for log-probs: 0 (greedy) reports log-probs at 1."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def sample_tokens(logits: Tensor, temperature: float, generator: Optional[torch.Generator] = None
                  ) -> tuple[Tensor, Tensor]:
    """Sample bin indices from ``logits [..., num_bins]``; returns (indices int64, log-probs float32)."""
    logp_all = F.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)
    if temperature == 0:
        idx = logits.argmax(dim=-1)
    else:
        # Inverse-CDF sampling: one uniform per token (torch.multinomial spends ~25% of act() drawing more).
        cdf = logp_all.reshape(-1, logp_all.shape[-1]).exp().cumsum(-1)
        u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
        idx = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).reshape(logp_all.shape[:-1])
    return idx, logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


class VLAPolicy(torch.nn.Module, abc.ABC):
    """Images + proprio + instruction -> ``tokens_per_call`` action tokens (one chunk)."""

    tokenizer: ActionTokenizer
    tokens_per_call: int

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abc.abstractmethod
    def action_logits(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                      action_tokens: Optional[Tensor]) -> Tensor:
        """Logits ``[B, T, num_bins]`` of every action position, teacher-forced on ``action_tokens`` where
        the decoding is autoregressive (ignored by parallel decoding)."""

    @abc.abstractmethod
    def _sample(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str], temperature: float,
                generator: Optional[torch.Generator]) -> tuple[Tensor, Tensor]:
        """Bin indices and log-probs ``[B, T]`` of one sampled chunk (no grad)."""

    def act(self, images: np.ndarray, proprio: np.ndarray, instructions: list[str], temperature: float,
            generator: Optional[torch.Generator] = None) -> tuple[np.ndarray, np.ndarray]:
        """Sample one chunk per batch row: (action token ids int64 [B, T], behaviour log-probs float32 [B, T])."""
        if len(instructions) != len(images):
            raise ValueError(f"{len(images)} images but {len(instructions)} instructions")
        with torch.inference_mode():
            idx, logp = self._sample(images, proprio, instructions, temperature, generator)
        tokens = self.tokenizer.index_to_token(idx.cpu().numpy().astype(np.int64))
        return tokens, logp.cpu().numpy().astype(np.float32)

    def token_logprobs(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                       action_tokens: Tensor, temperature: float) -> Tensor:
        """Differentiable log-probs ``[B, T]`` of given action token ids under ``log_softmax(logits / T)``."""
        logp_all, idx = self._action_log_softmax(images, proprio, instructions, action_tokens, temperature)
        return logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1)

    def _action_log_softmax(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                            action_tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """``log_softmax(logits / T)`` over the action bins ``[B, T, bins]`` and the tokens' bin indices."""
        tokens = torch.as_tensor(action_tokens, device=self.device).long()
        idx = self.tokenizer.token_to_index(tokens)
        if bool(((idx < 0) | (idx >= self.tokenizer.num_bins)).any()):
            raise ValueError("action_tokens contain ids outside the action-token range")
        logits = self.action_logits(images, proprio, instructions, idx)
        return F.log_softmax(logits.float() / effective_temperature(temperature), dim=-1), idx

    def token_logprobs_entropy(self, images: ArrayLike, proprio: ArrayLike, instructions: Sequence[str],
                               action_tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """``token_logprobs`` and, from the same forward, the entropy ``[B, T]`` of each position's action
        distribution at that temperature (actor/entropy). The entropy is detached: it is logged, never a loss term,
        and under the learner's grad forward (proximal_pass=auto) a graph for it would hold a ``[B, T, bins]``
        tensor until the backward."""
        logp_all, idx = self._action_log_softmax(images, proprio, instructions, action_tokens, temperature)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1), entropy

    def decode_actions(self, action_tokens: np.ndarray) -> np.ndarray:
        """Token ids ``[B, T]`` -> un-normalised actions ``[B, chunk, dof]`` (float32)."""
        return self.tokenizer.decode_actions(np.asarray(action_tokens))


# --------------------------------------------------------------------------------------------- factory
def default_tokenizer(policy_cfg: "PolicyConfig", env_kind: str = "builtin") -> ActionTokenizer:
    """Tokenizer with identity statistics (actions already in [-1, 1]) under the env family's key."""
    key = policy_cfg.unnorm_key or env_kind
    return ActionTokenizer(vocab_size=policy_cfg.vocab_size, num_bins=policy_cfg.num_bins,
                           chunk_size=policy_cfg.chunk_size, action_dim=policy_cfg.action_dim,
                           stats={key: ActionStats.identity(policy_cfg.action_dim)}, unnorm_key=key)


# The policy fields a saved tiny checkpoint fixes: when the config names other values, the checkpoint's are used
# (with a warning), since its weights only fit its own shapes.
ARCHITECTURE_FIELDS = ("decoding", "hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size",
                       "num_bins", "chunk_size", "action_dim", "proprio_dim", "max_instruction_tokens", "keypoints",
                       "lang_keypoints", "action_head", "action_head_freqs")


def build_policy(cfg: "Config", device: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> VLAPolicy:
    """A tiny random policy, or the checkpoint at ``cfg.policy.path`` (ours, or an OpenVLA/OFT HF dir), on ``device``
    in ``dtype``. Unset: an OpenVLA checkpoint loads onto the current GPU in bf16 (the CPU in fp32 without one), a
    tiny policy stays on the CPU in fp32."""
    pcfg = cfg.policy
    if pcfg.arch in ("openvla", "openvla_oft"):
        from async_vla.policy.openvla_loader import load_openvla_policy

        return load_openvla_policy(pcfg, device, dtype)
    if pcfg.path is not None:
        policy = load_policy(pcfg.path)
        mismatched = [k for k in ARCHITECTURE_FIELDS if getattr(policy.policy_cfg, k) != getattr(pcfg, k)]
        if mismatched:
            warnings.warn(f"policy.path={pcfg.path}: the checkpoint's {mismatched} differ from the config; "
                          f"the checkpoint's values are used", stacklevel=2)
        if pcfg.unnorm_key is not None:
            policy.tokenizer.unnorm_key = pcfg.unnorm_key
    else:
        from async_vla.policy.model import TinyVLA

        torch.manual_seed(cfg.run.seed)
        policy = TinyVLA(pcfg, default_tokenizer(pcfg, cfg.env.kind))
    return policy.to(device=device, dtype=dtype) if device is not None or dtype is not None else policy


def save_policy(policy: VLAPolicy, directory: Union[str, Path]) -> Path:
    """Write ``model.safetensors`` + ``async_vla_policy.json`` (policy config and tokenizer stats)."""
    from safetensors.torch import save_model

    policy_cfg = getattr(policy, "policy_cfg", None)
    if policy_cfg is None or policy_cfg.arch != "tiny":
        raise ValueError("save_policy writes tiny-arch policies; OpenVLA checkpoints are saved with save_pretrained")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_model(policy, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format_version": FORMAT_VERSION, "policy": policy_cfg.model_dump(mode="json"),
            "tokenizer": policy.tokenizer.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return directory


def load_policy(directory: Union[str, Path], map_location: str = "cpu") -> VLAPolicy:
    """Inverse of ``save_policy``."""
    from safetensors.torch import load_model

    from async_vla.config import PolicyConfig
    from async_vla.policy.model import TinyVLA

    directory = Path(directory)
    meta_path = directory / CONFIG_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a saved async_vla policy (no {CONFIG_FILE})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: unsupported format_version {meta.get('format_version')}")
    pcfg = PolicyConfig.model_validate({**meta["policy"], "path": str(directory)})
    policy = TinyVLA(pcfg, ActionTokenizer.from_dict(meta["tokenizer"]))
    load_model(policy, str(directory / WEIGHTS_FILE), strict=True, device=map_location)
    return policy
