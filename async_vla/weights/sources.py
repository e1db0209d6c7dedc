"""Where an actor's new weights come from: one chain, tried in order at every swap point (``WeightSources``).

1. ``Broadcast``: the newest version the learner broadcast to this actor (its ``WeightSubscriber``).
2. ``CatchUp``: the learner's newest export, once the buffer has refused this actor's weights ("behind" or "dead")
   for ``CATCH_UP_GRACE_S``; with ``weights.fetch`` first mirrored from the learner's node (``files``).

Each source counts what it handed over (``WeightSources.taken``)."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Optional, Protocol

from async_vla.messages import PolicyTag

log = logging.getLogger(__name__)

CATCH_UP_GRACE_S = 1.0   # refused this long before reading the export (a broadcast is probably on its way)
Weights = tuple[PolicyTag, dict]


class WeightSource(Protocol):
    name: str

    def poll(self, holding: PolicyTag, refused: str) -> Optional[Weights]:
        """Newer weights than ``holding`` if this source has them now; ``refused``: the buffer's last word on
        ``holding`` ("" granted, "wait", "behind", "dead")."""


class Broadcast:
    """The learner's broadcasts, as the subscriber received them."""

    name = "broadcast"

    def __init__(self, subscriber: Any):
        self.subscriber = subscriber

    def poll(self, holding: PolicyTag, refused: str) -> Optional[Weights]:
        return self.subscriber.poll()


class CatchUp:
    """The learner's newest export, when the buffer refuses the weights held. ``mirror(newer_than)``: copies the learner
    node's newest export into the subscriber's directory first (``weights.fetch``), or None."""

    name = "export"

    def __init__(self, subscriber: Any, mirror: Optional[Callable[[Optional[PolicyTag]], Any]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.subscriber, self.mirror, self.clock = subscriber, mirror, clock
        self._refused_since: Optional[float] = None
        self._next = 0.0

    def latest(self) -> Optional[Weights]:
        """Whatever the learner exported last (an actor's start)."""
        if self.mirror is not None:
            self.mirror(None)
        return self.subscriber.fetch_latest()

    def poll(self, holding: PolicyTag, refused: str) -> Optional[Weights]:
        now = self.clock()
        if refused not in ("behind", "dead"):
            self._refused_since = None
            return None
        if self._refused_since is None:
            self._refused_since = now
        if now - self._refused_since < CATCH_UP_GRACE_S or now < self._next:
            return None
        self._next = now + CATCH_UP_GRACE_S
        if self.mirror is not None:
            self.mirror(holding)
        return self.subscriber.fetch_latest(newer_than=holding)   # reads tensors only if newer


class WeightSources:
    """The chain: the first source with newer weights wins."""

    def __init__(self, *sources: WeightSource):
        self.sources = sources
        self.taken: collections.Counter = collections.Counter()   # source name -> versions handed over

    def poll(self, holding: PolicyTag, refused: str) -> Optional[Weights]:
        for source in self.sources:
            got = source.poll(holding, refused)
            if got is not None:
                self.taken[source.name] += 1
                if source.name != "broadcast":
                    log.info("weights: %s -> %s from the %s", holding, got[0], source.name)
                return got
        return None
