"""Building a policy from the config (a tiny random one, ours from a checkpoint, or an OpenVLA / OFT one), and our
own checkpoint directories: ``save_policy`` / ``load_policy`` and the version a saved directory holds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from async_vla.policy.interface import VLAPolicy
from async_vla.tokenizer import ActionStats, ActionTokenizer

if TYPE_CHECKING:
    from async_vla.config import Config, PolicyConfig

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


def default_tokenizer(policy_cfg: "PolicyConfig", env_kind: str = "builtin") -> ActionTokenizer:
    """Tokenizer with identity statistics (actions already in [-1, 1]) under the env family's key."""
    key = policy_cfg.unnorm_key or env_kind
    return ActionTokenizer(vocab_size=policy_cfg.vocab_size, num_bins=policy_cfg.num_bins,
                           chunk_size=policy_cfg.chunk_size, action_dim=policy_cfg.action_dim,
                           stats={key: ActionStats.identity(policy_cfg.action_dim)}, unnorm_key=key)


# The policy fields a saved tiny checkpoint fixes: when the config names other values, the checkpoint's are used
# (with a warning), since its weights only fit its own shapes.
ARCHITECTURE_FIELDS = ("decoding", "hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size",
                       "patch_tokens", "patch_pos",
                       "num_bins", "chunk_size", "action_dim", "proprio_dim", "max_instruction_tokens", "keypoints",
                       "lang_keypoints", "action_head", "action_head_freqs", "keypoint_shift")


def build_policy(cfg: "Config", device: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> VLAPolicy:
    """A tiny random policy, or the checkpoint at ``cfg.policy.path``, on ``device`` in ``dtype`` (unset: OpenVLA on the
    current GPU in bf16, else the CPU in fp32; tiny on the CPU in fp32)."""
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
