"""Learner -> actor weight broadcast: the publisher (learner rank 0), the subscriber (each actor), and the exported
safetensors files a restarted actor starts from. Design: docs/WEIGHTS.md.

Inside: ``publisher`` / ``subscriber`` / ``members`` (control plane: store, epochs, membership), ``transport``
(the interface of a path) with ``transport_wire`` / ``transport_shm`` / ``transport_bell`` (one per path), ``wire`` (one
version over a torch.distributed group), ``buckets`` / ``packer`` / ``pool`` (bucket layout, packing, buffer
reuse), ``shm`` / ``shm_reader`` (same-host shared-memory segments), ``bell`` / ``bell_versions`` (the same-host
doorbell), ``export`` (files) and ``native`` (the C kernels)."""
from async_vla.weights.buckets import checksum
from async_vla.weights.export import read_latest
from async_vla.weights.publisher import WeightPublisher
from async_vla.weights.subscriber import WeightSubscriber

__all__ = ["WeightPublisher", "WeightSubscriber", "checksum", "read_latest"]
