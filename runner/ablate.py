"""The seeds' ablations on the built-in task (``bin/ablate``): variants, and the table from the runs' summaries.

Every variant is the same config (seeds, budget, task set) plus a few dotted overrides; each run is a normal
``bin/train`` run directory, so its TensorBoard logs, ledger and plot are there to inspect afterwards. The
table reports what the run's ``summary.json`` says: final and best held-out greedy success, the wall time at
which held-out success first reached the threshold (``None`` = never within the budget), versions trained and
the share of groups the buffer admitted. Nothing here starts processes; ``bin/ablate`` does.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]
    what: str  # one line for the table: what differs from the default


VARIANTS: tuple[Variant, ...] = (
    Variant("default", (), "the config as given (quickstart: dynamic sampling, clip 0.2/0.28, eta 2, none)"),
    Variant("no_dynamic_sampling", ("buffer.dynamic_sampling=false",),
            "uniform groups are trained on too (advantage 0)"),
    Variant("symmetric_clip", ("loss.eps_high=0.2",), "clip 0.2/0.2 instead of clip-higher 0.2/0.28"),
    Variant("eta4_none", ("buffer.max_staleness=4", "loss.correction=none"), "staleness up to 4, no correction"),
    Variant("eta4_tis", ("buffer.max_staleness=4", "loss.correction=tis"), "staleness up to 4, truncated IS"),
    Variant("eta4_mis", ("buffer.max_staleness=4", "loss.correction=mis"), "staleness up to 4, masked IS"),
    Variant("nsr_on", ("loss.nsr=band",), "near-boundary stochastic rescue on"),
)


def select(names: Optional[Sequence[str]]) -> list[Variant]:
    """The variants named (all when none); an unknown name is an error that lists the known ones."""
    if not names:
        return list(VARIANTS)
    known = {v.name: v for v in VARIANTS}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {sorted(known)}")
    return [known[n] for n in names]


def time_to(evals: Sequence[dict], threshold: float) -> Optional[float]:
    """Wall seconds of the first held-out evaluation at or above ``threshold`` (None if never)."""
    for point in evals:
        if point["success_rate"] >= threshold:
            return float(point["wall_s"])
    return None


@dataclass
class RunResult:
    variant: str
    seed: int
    run_dir: str
    final: Optional[float] = None
    best: Optional[float] = None
    time_to_threshold_s: Optional[float] = None
    versions: Optional[int] = None
    admitted_frac: Optional[float] = None
    lag_max: Optional[int] = None  # the largest policy lag among trained trajectories (<= eta by design)
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)


def result_from_summary(variant: str, seed: int, run_dir: Path, threshold: float) -> RunResult:
    """Read one finished run; a missing or unreadable summary becomes a row with ``error`` set, never a crash."""
    path = Path(run_dir) / "summary.json"
    res = RunResult(variant, seed, str(run_dir))
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        res.error = f"no summary ({type(exc).__name__}: {exc})"
        return res
    ledger = s.get("ledger") or {}
    groups = ledger.get("groups") or {}  # per-group counts: accepted, filtered_uniform, stale, trained, ...
    # The outcome filters' verdicts only: a group accepted and later purged as stale is counted in both
    # "accepted" and "stale", and "expired_empty" (grants never started) and "trained" are not verdicts at all.
    decided = sum(v for k, v in groups.items() if k == "accepted" or k.startswith("filtered_"))
    res.final, res.best = s.get("final_eval_success"), s.get("best_eval_success")
    res.time_to_threshold_s = time_to(s.get("eval") or [], threshold)
    res.versions = s.get("final_version")
    res.admitted_frac = groups.get("accepted", 0) / decided if decided else None
    res.lag_max = ledger.get("lag_max")
    res.extra["group_counts"] = dict(groups)
    return res


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{100 * v:.0f}%"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def table(results: Sequence[RunResult], threshold: float, budget_s: float) -> str:
    """Markdown: one row per variant (means over seeds; time to threshold counts runs that got there)."""
    by_variant: dict[str, list[RunResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    what = {v.name: v.what for v in VARIANTS}
    lines = [f"| variant | what differs | seeds | final | best | reached {threshold:.0%} | time to {threshold:.0%} (s) "
             f"| versions | groups admitted | max lag trained |", "|" + "---|" * 10]
    for name, runs in by_variant.items():
        ok = [r for r in runs if r.error is None]
        reached = [r.time_to_threshold_s for r in ok if r.time_to_threshold_s is not None]
        lines.append("| " + " | ".join([
            name, what.get(name, ""), str(len(runs)), _fmt(_mean([r.final for r in ok]), True),
            _fmt(_mean([r.best for r in ok]), True), f"{len(reached)}/{len(runs)}",
            _fmt(_mean(reached)), _fmt(_mean([r.versions for r in ok])),
            _fmt(_mean([r.admitted_frac for r in ok]), True),
            _fmt(max((r.lag_max for r in ok if r.lag_max is not None), default=None))]) + " |")
    errors = [r for r in results if r.error]
    notes = [f"Budget {budget_s:.0f} s of wall time per run; held-out greedy success; means over seeds."]
    notes += [f"- {r.variant} seed {r.seed}: {r.error}" for r in errors]
    return "\n".join(lines + [""] + notes)
