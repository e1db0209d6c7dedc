"""Learner -> actor weights: ``publisher`` (learner rank 0) / ``subscriber`` (each actor) / ``members`` (control
plane), ``transport`` (an epoch's gloo or NCCL group) over ``wire``, ``buckets`` / ``packer`` / ``pool`` (layout,
packing, buffer reuse), ``export`` (safetensors files), ``files`` (the newest export served from the learner's node,
torch-free), ``sources`` (an actor's chain: broadcast, then catch-up), ``native`` (the packing kernel). Design:
docs/WEIGHTS.md. The names below are imported on first use, so ``async_vla.weights.files`` loads without torch."""
import importlib

_HOME = {"WeightPublisher": "publisher", "WeightSubscriber": "subscriber", "checksum": "buckets",
         "read_latest": "export"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'async_vla.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"async_vla.weights.{_HOME[name]}"), name)
