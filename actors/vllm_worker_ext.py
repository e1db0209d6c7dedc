"""Methods mixed into vLLM's GPU worker (``LLM(worker_extension_cls="actors.vllm_worker_ext.VLAWorkerExtension")``)
and called through ``LLM.collective_rpc("vla_...")``.

Two ways in for new weights, one install path (version guard -> name/shape check -> ``load_weights``):

- ``vla_load_tensors(version, named)``: the engine runs in the actor's process (the backend's default,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` hands over the very GPU tensors the actor's
  ``WeightSubscriber`` received from the learner over NCCL - no extra copy, no serialisation.
- ``vla_init_weight_group`` + ``vla_update_weights``: the worker joins a process group as a receiver and takes
  one version of the *same* bucketed stream as the torch actors (``async_vla.weights.wire.send_version`` /
  ``recv_version``: header, manifest, buckets, checksum, acknowledgement). That is for an engine in its own
  process on its own GPU (NCCL cannot connect two ranks on one device); the sender is whoever holds the
  weights (an actor relaying what it received). Gloo works too, which is how the CPU test drives it.

Only what the worker itself needs is imported here (no vLLM): vLLM provides ``self.model_runner`` and
``self.device``. Method and attribute names carry a ``vla_`` prefix because vLLM refuses an extension whose
names collide with the worker's own.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from actors.vllm_weights import NameMap, VersionGuard, WeightMappingError, specs_of


class VLAWorkerExtension:
    """See the module docstring. State lives in ``_vla_*`` attributes created by ``vla_setup``."""

    model_runner: Any
    device: Any

    def vla_setup(self, name_map_doc: Mapping[str, Any]) -> int:
        """Take the name map (plain data: this may run in another process). Returns the engine's parameter count."""
        self._vla_map = NameMap.from_doc(name_map_doc)
        self._vla_guard = VersionGuard()
        self._vla_group = None
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def vla_weights_version(self) -> Optional[int]:
        """Newest version installed (None = only the engine's initial/dummy weights)."""
        return self._vla_guard.current

    def vla_load_tensors(self, version: int, named: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                         full: bool = False, lineage: Optional[str] = None) -> dict[str, Any]:
        """Install ``named`` (our names) as ``version`` of learner ``lineage`` (``VersionGuard``; None: the installed one).
        ``full``: every engine parameter must be present (the first push, which replaces the dummy weights)."""
        named = dict(named.items() if isinstance(named, Mapping) else named)
        return self._vla_install(int(version), named, full, lineage)

    def vla_init_weight_group(self, host: str, port: int, rank: int, world: int, timeout_s: float = 60.0,
                              backend: str = "nccl", prefix: str = "vla/relay") -> None:
        """Join the sender's group as ``rank`` (the sender hosts the store and is rank 0)."""
        from torch.distributed import PrefixStore, TCPStore   # public names (not torch._C internals)

        from async_vla.weights.wire import BroadcastGroup, td

        if self._vla_group is not None:
            self._vla_group.close()
        store = TCPStore(host, int(port), None, False, td(timeout_s), wait_for_workers=False)
        self._vla_group = BroadcastGroup(backend, PrefixStore(prefix, store), int(rank), int(world),
                                         float(timeout_s), 0)

    def vla_update_weights(self, timeout_s: float = 60.0, full: bool = False,
                           lineage: Optional[str] = None) -> dict[str, Any]:
        """Receive one version from the group and install it (``lineage``: as ``vla_load_tensors``). A checksum
        mismatch installs nothing."""
        from async_vla.weights.wire import recv_version

        if self._vla_group is None:
            raise RuntimeError("vla_update_weights before vla_init_weight_group")
        h, layout, tensors, ok = recv_version(self._vla_group, timeout_s)
        if not ok:
            return {"version": h["version"], "installed": False, "error": "checksum mismatch"}
        return self._vla_install(h["version"], tensors, full, lineage)

    def vla_close_weight_group(self) -> None:
        if self._vla_group is not None:
            self._vla_group.close()
            self._vla_group = None

    def _vla_install(self, version: int, named: dict[str, torch.Tensor], full: bool,
                     lineage: Optional[str] = None) -> dict[str, Any]:
        t0 = time.monotonic()
        self._vla_guard.check(version, lineage)                         # refused: nothing changed
        self._vla_map.check(specs_of(named), full=full, engine_only=True)
        items = list(self._vla_map.engine_items(named.items()))
        try:
            loaded = self.model_runner.model.load_weights(weights=items)
        except KeyError as exc:   # a name the vLLM model does not know despite the map: say which
            raise WeightMappingError(f"vLLM model has no parameter {exc} (mapped from our names)") from None
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)   # the copies are done before the next forward reads them
        self._vla_guard.commit(version, lineage)
        return {"version": version, "installed": True, "tensors": len(items),
                "bytes": sum(t.numel() * t.element_size() for _, t in items),
                "loaded": len(loaded) if loaded is not None else -1, "load_s": time.monotonic() - t0}
