"""What the learner changes in the policy it trains: LoRA adapters (``learner.lora_rank``, peft, on the language
model's linear layers; actors receive merged weights) and activation checkpointing
(``learner.gradient_checkpointing``, per decoder layer, only while gradients are recorded). The policy's names and
outputs stay as they are outside the learner. Why and how: docs/LEARNER.md "LoRA and activation checkpointing"."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from async_vla.config.sections import LearnerConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = "default"


def language_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The policy's transformer LM: ``llm`` (the tiny arch) or ``model.language_model`` (Prismatic)."""
    lm = getattr(policy, "llm", None)
    if lm is None:
        lm = getattr(getattr(policy, "model", None), "language_model", None)
    if lm is None:
        raise ValueError(f"{type(policy).__name__} has no language model (`llm` or `model.language_model`) to adapt")
    return lm


def decoder_layers(lm: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", lm)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(lm).__name__}: no decoder `layers` to checkpoint")
    return layers


def apply_lora(policy: torch.nn.Module, rank: int, alpha: float) -> torch.nn.Module:
    """peft LoRA adapters on the LM's linear layers; every other parameter frozen. In place; returns ``policy``."""
    from peft import LoraConfig, inject_adapter_in_model

    lm = language_model(policy)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                       init_lora_weights="gaussian", bias="none"), lm, adapter_name=ADAPTER)
    for name, p in policy.named_parameters():
        p.requires_grad_(".lora_" in name)
    if not any(p.requires_grad for p in policy.parameters()):
        raise ValueError(f"learner.lora_rank={rank}: no layer named {LORA_TARGETS} in the language model")
    return policy


def enable_checkpointing(policy: torch.nn.Module) -> torch.nn.Module:
    """Recompute each decoder layer in the backward pass (docs/LEARNER.md "LoRA and activation checkpointing"). In
    place; idempotent."""
    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(language_model(policy)):
        if getattr(layer, "_async_vla_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward
        layer._async_vla_checkpointed = True
    return policy


def prepare_for_training(policy: torch.nn.Module, lc: "LearnerConfig") -> torch.nn.Module:
    """Apply ``learner.lora_rank`` and ``learner.gradient_checkpointing`` (both off: the policy untouched)."""
    if lc.lora_rank:
        apply_lora(policy, lc.lora_rank, lc.lora_alpha)
    if lc.gradient_checkpointing:
        enable_checkpointing(policy)
    return policy


def lora_scale(lc: "LearnerConfig") -> Optional[float]:
    return lc.lora_alpha / lc.lora_rank if lc.lora_rank else None


def merge_lora_items(items: Iterable[tuple[str, Tensor]], scale: Optional[float]) -> Iterator[tuple[str, Tensor]]:
    """The policy's own (name, tensor) stream from the learner's: ``X.base_layer.*`` -> ``X.*`` with each adapted weight
    merged (``W + scale B A``), adapters not emitted; holds one layer's base weight until its A and B arrive. ``scale``
    None (no LoRA): the items as they come."""
    if scale is None:
        yield from items
        return
    base: dict[str, Tensor] = {}
    lora: dict[str, dict[str, Tensor]] = {}
    for name, t in items:
        if ".lora_A." in name or ".lora_B." in name:
            prefix, kind = (name.split(".lora_A.")[0], "A") if ".lora_A." in name else (name.split(".lora_B.")[0], "B")
            lora.setdefault(prefix, {})[kind] = t.detach().clone()
            if len(lora[prefix]) == 2 and prefix in base:
                yield prefix + ".weight", _merged(base.pop(prefix), lora.pop(prefix), scale)
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            if len(lora.get(prefix, {})) == 2:
                yield prefix + ".weight", _merged(t, lora.pop(prefix), scale)
            else:
                base[prefix] = t.detach().clone()
            continue
        yield name.replace(".base_layer.", "."), t
    if base or lora:
        raise RuntimeError(f"LoRA layers without their adapters or base weight: {sorted(base) + sorted(lora)}")


def _merged(weight: Tensor, ab: dict[str, Tensor], scale: float) -> Tensor:
    delta = (ab["B"].float() @ ab["A"].float()) * scale
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


@contextlib.contextmanager
def merged_view(policy: torch.nn.Module, scale: Optional[float]) -> Iterator[torch.nn.Module]:
    """Inside: ``policy`` is its plain architecture with merged weights (each peft LoRA layer replaced by its base
    layer holding ``W + scale B A``), for saving it; outside, the adapters are back and the base weights untouched."""
    if scale is None:
        yield policy
        return
    swapped = []
    for parent_name, parent in list(policy.named_modules()):
        for child_name, child in list(parent.named_children()):
            base = getattr(child, "base_layer", None)
            if base is None or not hasattr(child, "lora_A"):
                continue
            a, b = child.lora_A[ADAPTER].weight, child.lora_B[ADAPTER].weight
            original = base.weight.data
            base.weight.data = _merged(original, {"A": a.data, "B": b.data}, scale)
            setattr(parent, child_name, base)
            swapped.append((parent, child_name, child, base, original))
    try:
        yield policy
    finally:
        for parent, child_name, child, base, original in swapped:
            base.weight.data = original
            setattr(parent, child_name, child)
