"""What a SimpleVLA-RL / OpenVLA-OFT checkpoint needs around its Prismatic remote code to run as upstream runs it
(each rule and the upstream file it follows: docs/FIDELITY.md): ``ensure_robot_platform`` sets ``ROBOT_PLATFORM``
before the remote code is imported (else it fixes ALOHA's 25 x 14 action positions); ``check_action_positions``
refuses a forward whose position count is not chunk x dim; ``make_bidirectional`` gives the language model a
padding-only 4D mask (OFT runs its Llama bidirectionally); the action statistics come from
``dataset_statistics.json`` with the ``libero_X`` -> ``libero_X_no_noops`` fallback."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

log = logging.getLogger(__name__)

PLATFORM_ENV = "ROBOT_PLATFORM"
# verl/utils/vla_utils/openvla_oft/constants.py: platform -> (NUM_ACTIONS_CHUNK, ACTION_DIM)
ROBOT_PLATFORMS = {"LIBERO": (8, 7), "ALOHA": (25, 14), "ALOHA_12": (12, 14), "ALOHA_8": (8, 14),
                   "ALOHA_6": (6, 14), "BRIDGE": (5, 7)}
FALLBACK_PLATFORM = "ALOHA"              # constants.py's default when neither env nor argv names a platform
STATISTICS_FILE = "dataset_statistics.json"


def robot_platform(chunk_size: int, action_dim: int) -> str:
    """The ``ROBOT_PLATFORM`` whose constants give ``chunk_size`` x ``action_dim``."""
    for name, shape in ROBOT_PLATFORMS.items():
        if shape == (chunk_size, action_dim):
            return name
    raise ValueError(f"policy.chunk_size={chunk_size} x policy.action_dim={action_dim} matches no platform of the "
                     f"OpenVLA-OFT remote code's constants.py ({ROBOT_PLATFORMS}); LIBERO is 8 x 7")


def ensure_robot_platform(chunk_size: int, action_dim: int) -> str:
    """Set ``ROBOT_PLATFORM`` for the remote code (before it is imported) or refuse a conflicting value."""
    want = robot_platform(chunk_size, action_dim)
    have = os.environ.get(PLATFORM_ENV, "").strip().upper()
    if not have:
        os.environ[PLATFORM_ENV] = want
        return want
    if have != want:
        got = ROBOT_PLATFORMS.get(have)
        raise ValueError(f"{PLATFORM_ENV}={have} gives the checkpoint's remote code {got or 'unknown'} action "
                         f"positions (chunk x dim) but policy.chunk_size x policy.action_dim = "
                         f"{chunk_size} x {action_dim} is {want}: set {PLATFORM_ENV}={want} or unset it")
    return want


def check_action_positions(logits: torch.Tensor, chunk_size: int, action_dim: int) -> None:
    """An OFT forward returns ``[B, chunk x dim, vocab]`` (modeling_prismatic.py ``forward``); anything else is an
    error naming what was expected (350 = the ALOHA fallback of constants.py)."""
    want = chunk_size * action_dim
    if logits.dim() != 3 or logits.shape[1] != want:
        hint = ""
        if logits.dim() == 3:
            for name, (c, d) in ROBOT_PLATFORMS.items():
                if c * d == logits.shape[1]:
                    hint = (f" ({logits.shape[1]} = {c} x {d} is the {name} platform"
                            + (f", constants.py's fallback when {PLATFORM_ENV} is unset" if name == FALLBACK_PLATFORM
                               else "") + f": the remote code was imported with other constants; set "
                            f"{PLATFORM_ENV}={robot_platform(chunk_size, action_dim)} before loading, in a fresh "
                            f"process (openvla-oft's own constants.py reads the words of the command line instead: "
                            f"no 'aloha' or 'bridge' in it))")
                    break
        raise ValueError(f"the OpenVLA-OFT forward returned logits of shape {tuple(logits.shape)}; expected "
                         f"[batch, {want}, vocab]: policy.chunk_size x policy.action_dim = {chunk_size} x "
                         f"{action_dim} action positions{hint}")


# ------------------------------------------------------------------------------------------- attention
def _bidirectional_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 4:           # already a full mask: whoever built it meant it
        return args, kwargs
    embeds = kwargs.get("inputs_embeds")
    ref = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
    if ref is None:
        return args, kwargs
    b, n = ref.shape[0], ref.shape[1]
    keep = torch.ones(b, n, dtype=torch.bool, device=ref.device) if mask is None else mask.bool()
    dtype = embeds.dtype if embeds is not None else next(module.parameters()).dtype
    full = torch.zeros(b, 1, n, n, dtype=dtype, device=ref.device)
    full.masked_fill_(~keep[:, None, None, :], torch.finfo(dtype).min)   # padding keys only: no causal triangle
    kwargs["attention_mask"] = full
    return args, kwargs


def make_bidirectional(language_model: torch.nn.Module) -> torch.nn.Module:
    """Run ``language_model`` with bidirectional attention, as OpenVLA-OFT's transformers fork does: every call's
    2D padding mask (or none) becomes a 4D additive mask that hides padding keys only. Idempotent."""
    if getattr(language_model, "_async_vla_bidirectional", False):
        return language_model
    impl = getattr(getattr(language_model, "config", None), "_attn_implementation", None) or ""
    if impl.startswith("flash"):
        raise ValueError(f"the OFT language model uses attn_implementation={impl!r}, which takes no 4D mask and so "
                         "cannot run bidirectionally; load it with sdpa or eager (SimpleVLA-RL loads OFT without "
                         "flash attention)")
    for sub in language_model.modules():
        if hasattr(sub, "is_causal"):
            sub.is_causal = False      # SDPA's own causal flag, used when a layer is called without a mask
    language_model.register_forward_pre_hook(_bidirectional_mask, with_kwargs=True)
    language_model._async_vla_bidirectional = True
    return language_model


def _no_labels(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs["labels"] = None
    return args, kwargs


def drop_lm_labels(language_model: torch.nn.Module) -> torch.nn.Module:
    """Call ``language_model`` without labels (openvla-oft's forward passes its placeholder labels on, which would
    compute a loss nobody reads; its ``predict_action`` runs without them). Idempotent."""
    if not getattr(language_model, "_async_vla_no_labels", False):
        language_model.register_forward_pre_hook(_no_labels, with_kwargs=True)
        language_model._async_vla_no_labels = True
    return language_model


# ----------------------------------------------------------------------------------------- statistics
def load_dataset_statistics(directory: Union[str, Path]) -> Optional[dict]:
    """``<checkpoint>/dataset_statistics.json`` (the statistics the SFT run wrote), or None when absent."""
    path = Path(directory) / STATISTICS_FILE
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(stats, dict):
        raise ValueError(f"{path} must hold an object of dataset keys, got {type(stats).__name__}")
    return stats


def resolve_unnorm_key(key: Optional[str], available: Mapping[str, Any]) -> Optional[str]:
    """``key``, or ``key + "_no_noops"`` when only that exists for a LIBERO key (rob_rollout.py vla_preprocess)."""
    if key is None or key in available:
        return key
    if key.startswith("libero") and f"{key}_no_noops" in available:
        log.warning("policy.unnorm_key=%s: using the checkpoint's %s_no_noops statistics (as SimpleVLA-RL does)", key, key)
        return f"{key}_no_noops"
    return key
