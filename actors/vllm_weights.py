"""What the vLLM backend needs that does not need vLLM (tested on CPU): name mapping (``NameMap``: explicit prefix
rules from our names to the engine's Hugging Face Llama names, checked against its names and shapes before
anything is copied; unmatched names stay on the torch side, ``shared`` ones go to both), the version guard and
the update set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

Shape = tuple[int, ...]


class WeightMappingError(ValueError):
    """A tensor has no engine parameter, an engine parameter got no tensor, or the shapes differ."""


class StaleWeights(ValueError):
    """A weight version not newer than the one installed (stale or duplicate): refused, nothing changed."""


@dataclass
class VersionGuard:
    """Installed versions only move forward within a lineage; another lineage (a new learner) starts afresh. ``check``
    before touching any weight, ``commit`` after; ``lineage`` None means "the installed one"."""

    current: Optional[int] = None    # None: nothing installed from the version stream yet
    lineage: str = ""

    def check(self, version: int, lineage: Optional[str] = None) -> None:
        if (lineage is None or lineage == self.lineage) and self.current is not None and int(version) <= self.current:
            kind = "duplicate" if int(version) == self.current else "stale"
            raise StaleWeights(f"{kind} weights v{version}: v{self.current} is installed")

    def commit(self, version: int, lineage: Optional[str] = None) -> None:
        self.check(version, lineage)
        self.current = int(version)
        if lineage is not None:
            self.lineage = lineage


@dataclass(frozen=True)
class NameMap:
    """Explicit ``our name -> engine name`` rules plus the engine's parameter names and shapes."""

    rules: tuple[tuple[str, str], ...]          # (our prefix, engine prefix), first match wins
    targets: Mapping[str, Shape]                # engine name -> shape its load_weights expects
    shared: frozenset[str] = field(default_factory=frozenset)   # our names needed on the torch side too

    def engine_name(self, ours: str) -> Optional[str]:
        """The engine name of one of our tensors, or None when it lives on the torch side only."""
        for src, dst in self.rules:
            if ours.startswith(src):
                return dst + ours[len(src):]
        return None

    def on_torch_side(self, ours: str) -> bool:
        return ours in self.shared or self.engine_name(ours) is None

    def check(self, specs: Mapping[str, Shape], full: bool = False, engine_only: bool = False) -> None:
        """Raise ``WeightMappingError`` naming every problem of an update ``{our name: shape}``: an unmapped name, a
        shape mismatch, with ``full`` a missing engine parameter, with ``engine_only`` a name no rule maps."""
        unmapped, mismatched, covered = [], [], set()
        for ours, shape in specs.items():
            name = self.engine_name(ours)
            if name is None:
                if engine_only:
                    unmapped.append(f"{ours} (no rule maps it)")
                continue
            if name not in self.targets:
                unmapped.append(f"{ours} -> {name} (no such engine parameter)")
            elif tuple(shape) != tuple(self.targets[name]):
                mismatched.append(f"{ours} -> {name}: {tuple(shape)} vs engine {tuple(self.targets[name])}")
            covered.add(name)
        missing = sorted(set(self.targets) - covered) if full else []
        problems = [f"{what} ({len(items)}): {items[:5]}" for what, items in
                    (("unmapped", unmapped), ("shape mismatch", mismatched), ("missing", missing)) if items]
        if problems:
            raise WeightMappingError("weights do not match the vLLM model: " + "; ".join(problems))

    def engine_items(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(engine name, tensor) for every tensor that has an engine name (call ``check`` first)."""
        for ours, t in named:
            name = self.engine_name(ours)
            if name is not None:
                yield name, t

    # The worker extension runs in vLLM's worker (possibly another process): the map travels as plain data.
    def to_doc(self) -> dict[str, Any]:
        return {"rules": [list(r) for r in self.rules], "shared": sorted(self.shared),
                "targets": {k: list(v) for k, v in self.targets.items()}}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> "NameMap":
        return cls(tuple((str(a), str(b)) for a, b in doc["rules"]),
                   {str(k): tuple(int(d) for d in v) for k, v in doc["targets"].items()},
                   frozenset(doc.get("shared", ())))


def specs_of(named: Mapping[str, torch.Tensor]) -> dict[str, Shape]:
    return {k: tuple(int(d) for d in v.shape) for k, v in named.items()}


def strip_module_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSpeed-wrapped names carry ``module.``; the policy's own names do not."""
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def engine_update(state: Mapping[str, torch.Tensor], name_map: NameMap, trainable: Iterable[str]
                  ) -> dict[str, torch.Tensor]:
    """The tensors of an update that go to the engine: trainable ones with an engine name, in state order (frozen ones
    went once, at start). A trainable engine tensor missing from ``state`` is an error."""
    want = {n for n in trainable if name_map.engine_name(n) is not None}
    missing = sorted(want - state.keys())
    if missing:
        raise WeightMappingError(f"update lacks trainable engine parameters ({len(missing)}): {missing[:5]}")
    return {n: t for n, t in state.items() if n in want}


# ------------------------------------------------------------------------------------------ OpenVLA
LM_PREFIX = "model.language_model."


def openvla_name_map(policy: torch.nn.Module) -> NameMap:
    """Map of an ``OpenVLAPolicy``: engine names are the language model's own HF names (what vLLM's ``load_weights``
    takes), shapes read from the torch copy, so an LM differing from the engine's config fails the first push."""
    lm = policy.model.language_model
    targets = {n: tuple(p.shape) for n, p in lm.named_parameters()}
    embed = next(n for n, p in lm.named_parameters() if p is lm.get_input_embeddings().weight)
    return NameMap(((LM_PREFIX, ""),), targets, frozenset({LM_PREFIX + embed}))
