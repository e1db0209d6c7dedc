"""Learner -> actor weights: the publisher (learner rank 0), the subscriber (each actor), the exported safetensors
files a restarted actor starts from, and the sources an actor takes new weights from. Design: docs/WEIGHTS.md.

Inside: ``publisher`` / ``subscriber`` / ``members`` (control plane: store, epochs, membership), ``transport``
(the interface of a path) with ``transport_wire`` (a gloo or NCCL group), ``wire`` (one version over a
torch.distributed group), ``buckets`` / ``packer`` / ``pool`` (bucket layout, packing, buffer reuse), ``export``
(files), ``files`` (the newest export served from the learner's node, torch-free), ``sources`` (an actor's chain:
broadcast, then catch-up) and ``native`` (the packing kernel).

The names below are imported on first use, so ``async_vla.weights.files`` loads without torch (the buffer process
serves the exports and never imports it)."""
import importlib

_HOME = {"WeightPublisher": "publisher", "WeightSubscriber": "subscriber", "checksum": "buckets",
         "read_latest": "export"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'async_vla.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"async_vla.weights.{_HOME[name]}"), name)
