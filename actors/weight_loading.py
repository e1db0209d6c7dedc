"""Putting weights into a policy: a received set of named tensors, or an exported file / directory
(``<run>/weights``) or a saved checkpoint. Used by the actor loop, the launcher's evaluator and ``bin/eval``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from async_vla.messages import PolicyTag


def load_weights(policy: torch.nn.Module, state: dict, tag: Optional[PolicyTag] = None) -> None:
    """Copy a full set of named tensors into the policy in place (between forward passes only). Every parameter must be
    present and no unknown name may appear (buffers and tied aliases may be absent). A policy holding weights outside
    the module (the vLLM backend) installs them itself with their ``tag`` and raises ``StaleWeights`` for an old one."""
    install = getattr(policy, "install_weights", None)
    if install is not None:
        install(state, tag)
        return
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    own = set(policy.state_dict().keys())
    missing = sorted({name for name, _ in policy.named_parameters()} - state.keys())
    unexpected = sorted(state.keys() - own)
    if missing or unexpected:  # checked before copying anything: a refused update leaves the policy intact
        raise ValueError(f"weights do not match the policy: missing {missing[:5]}, unexpected {unexpected[:5]}")
    policy.load_state_dict(state, strict=False)


def load_weights_path(path: str, fallback_version: int) -> tuple[int, dict]:
    """Weights at ``path`` - an exported ``v<N>.safetensors``, a weights dir (its ``latest``) or a ``save_policy`` dir -
    as (version, state); a checkpoint dir has no version of its own: ``fallback_version``."""
    from async_vla.weights.export import read_latest

    p = Path(path)
    if p.is_dir() and (p / "async_vla_policy.json").is_file():
        from async_vla.policy import load_policy

        return fallback_version, load_policy(p).state_dict()
    got = read_latest(p) if p.is_dir() else None
    if got is None and p.is_file():
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        m = re.match(r"^v(\d+)\.safetensors$", p.name)
        version = int(meta.get("version", m.group(1) if m else fallback_version))
        return version, load_file(str(p))
    if got is None:
        raise FileNotFoundError(f"no weights at {path}")
    return got[0].version, got[1]
