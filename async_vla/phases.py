"""Where a process's time goes: a ``PhaseClock`` charges every second since it was made to exactly one phase.

    clock = PhaseClock()
    with clock.phase("env_step"):
        env.step(...)
    clock.seconds()   # {"env_step": 0.8, "other": 0.2}: cumulative, summing to the clock's wall time

Time inside a ``phase`` is that phase's; time inside a phase nested in it is the inner phase's only (the outer
one is paused), and time in no phase is the clock's ``rest`` ("other" unless the owner names what that time is).
So the seconds of one process add up to its wall time and never count a second twice; "other" is what no phase
covers. The actor, learner and buffer each keep one and send ``seconds()`` in their messages (ActorStats,
BatchRequest; the buffer's own in its stats reply); ``phase_table`` sums the processes of one kind for
summary.json, and ``phase_scalars`` gives the TensorBoard tags ``time/<kind>/<phase>_frac``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, Iterable, Iterator, Mapping

OTHER = "other"
KINDS = ("actor", "learner", "buffer")
"""The process kinds a run's table has, in the order it shows them."""


class PhaseClock:
    """Cumulative seconds per phase of one process (or one component of the serial process); ``clock`` is the
    time source (injected in tests)."""

    def __init__(self, rest: str = OTHER, clock: Callable[[], float] = time.monotonic):
        self.rest = rest
        self._clock = clock
        self._mark = clock()
        self._seconds: collections.Counter = collections.Counter()
        self._stack: list[str] = []

    def _charge(self) -> None:
        now = self._clock()
        self._seconds[self._stack[-1] if self._stack else self.rest] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside to ``name`` (less the time of phases nested inside it)."""
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def seconds(self) -> dict[str, float]:
        """Seconds per phase since the clock was made (the phase running now counted up to now): they sum to the
        wall time. Phases never entered are absent."""
        self._charge()
        return {name: s for name, s in self._seconds.items() if s > 0}


def since(now: Mapping[str, float], earlier: Mapping[str, float]) -> dict[str, float]:
    """The seconds per phase spent between two ``seconds()`` of one clock."""
    return {name: s - earlier.get(name, 0.0) for name, s in now.items()}


def phase_table(processes: Iterable[Mapping[str, float]]) -> dict:
    """The processes of one kind together: ``{"processes": n, "wall_s": their wall times summed, "seconds": {phase:
    summed}, "frac": {phase: seconds / wall_s}}`` (phases sorted by time, largest first, "other" last)."""
    total: collections.Counter = collections.Counter()
    n = 0
    for seconds in processes:
        total.update({name: float(s) for name, s in seconds.items()})
        n += 1
    wall = sum(total.values())
    order = sorted(total, key=lambda name: (name == OTHER, -total[name]))
    return {"processes": n, "wall_s": wall, "seconds": {name: total[name] for name in order},
            "frac": {name: total[name] / wall if wall > 0 else 0.0 for name in order}}


def phase_scalars(tables: Mapping[str, dict]) -> dict[str, float]:
    """``time/<kind>/<phase>_frac`` of each table: the share of the kind's wall time each phase took so far."""
    return {f"time/{kind}/{name}_frac": frac for kind, table in tables.items() for name, frac in table["frac"].items()}
