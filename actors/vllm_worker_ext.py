"""Methods mixed into vLLM's GPU worker (``LLM(worker_extension_cls="actors.vllm_worker_ext.VLAWorkerExtension")``)
and called through ``LLM.collective_rpc("vla_...")``. The engine runs in the actor's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``vla_load_tensors`` gets the very GPU tensors the actor's
``WeightSubscriber`` received: version guard -> name/shape check -> ``load_weights``. vLLM provides
``self.model_runner`` and ``self.device``; names carry a ``vla_`` prefix (vLLM refuses names that collide with the
worker's own)."""

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
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def vla_weights_version(self) -> Optional[int]:
        """Newest version installed (None = only the engine's initial/dummy weights)."""
        return self._vla_guard.current

    def vla_load_tensors(self, version: int, named: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                         full: bool = False, lineage: Optional[str] = None) -> dict[str, Any]:
        """Install ``named`` (our names) as ``version`` of learner ``lineage`` (``VersionGuard``; None: the installed one).
        ``full``: every engine parameter must be present (the first push, which replaces the dummy weights)."""
        t0, version = time.monotonic(), int(version)
        named = dict(named.items() if isinstance(named, Mapping) else named)
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
