"""The seeds' ablations on the built-in task (``bin/ablate``): variants (dotted overrides of one config; one the
config cannot take is *unavailable*) and the table from the runs' summaries: per variant the final held-out
success of each seed, their mean with a 95% Student-t interval over seeds, and the pooled Wilson interval. In
serial mode every run trains at a fixed lag equal to its eta (``serial_lag_overrides``); variants with equal
resolved configs run once (``same_config``). Starts no processes."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from async_vla.evalstats import wilson_interval

# Two-sided 95% Student-t quantiles by degrees of freedom (n - 1 seeds); normal beyond the table.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]
    what: str  # one line for the table: what differs from the default


def _correction_variants() -> list[Variant]:
    out = []
    for eta in (0, 2, 4):
        for corr in ("none", "tis", "mis"):
            out.append(Variant(f"eta{eta}_{corr}", (f"buffer.max_staleness={eta}", f"loss.correction={corr}"),
                               f"staleness up to {eta}, correction {corr}"))
    return out


VARIANTS: tuple[Variant, ...] = (
    Variant("default", (), "the config as given (quickstart: dynamic sampling, clip 0.2/0.28, no NSR, eta 2, none)"),
    Variant("no_dynamic_sampling", ("buffer.dynamic_sampling=false",),
            "uniform groups are trained on too (advantage 0)"),
    Variant("symmetric_clip", ("loss.eps_high=0.2",), "clip 0.2/0.2 instead of clip-higher 0.2/0.28"),
    Variant("nsr_on", ("loss.nsr=band",), "near-boundary stochastic rescue on"),
    *_correction_variants(),
    # PPO mini-batches per batch (each size must divide buffer.groups_per_batch / learner.num_ranks).
    *(Variant(f"k{k}", (f"learner.minibatches={k}",), f"{k} optimizer steps per batch (mini-batches)")
      for k in (1, 2, 4)),
    # AReaL's pairing: the decoupled loss (tis / mis clips around the proximal policy) needs several optimizer steps
    # per batch before its clip binds; against PPO around the sampler (none) at the same k, at staleness 4.
    *(Variant(f"k{k}_eta4_{corr}", ("buffer.max_staleness=4", f"loss.correction={corr}", f"learner.minibatches={k}"),
              f"{k} optimizer steps per batch, staleness up to 4, correction {corr}")
      for k in (2, 4) for corr in ("none", "tis", "mis")),
)


def serial_lag_overrides(resolved) -> list[str]:
    """Extra overrides for a resolved config: in serial mode, a fixed lag of η (see the module docstring)."""
    if resolved.run.mode != "serial":
        return []
    return [f"run.serial_lag={resolved.buffer.max_staleness}"]


def same_config(configs: dict[str, dict]) -> dict[str, str]:
    """{variant: earlier variant with an equal resolved config} (configs: name -> resolved config dump, in run
    order); those variants are not run again but share the earlier one's runs."""
    seen: list[tuple[str, dict]] = []
    out: dict[str, str] = {}
    for name, conf in configs.items():
        twin = next((n for n, c in seen if c == conf), None)
        if twin is None:
            seen.append((name, conf))
        else:
            out[name] = twin
    return out


def available(variant: Variant, validate: Callable[[list[str]], object]) -> Optional[str]:
    """None when ``validate(overrides)`` accepts the variant's overrides, else why not (the config error)."""
    try:
        validate(list(variant.overrides))
    except ValueError as exc:
        return str(exc).strip().splitlines()[-1]
    return None


def select(names: Optional[Sequence[str]], validate: Optional[Callable[[list[str]], object]] = None
           ) -> tuple[list[Variant], list[str]]:
    """(variants to run, notes). Named ones must exist and be valid; with no names, every valid one runs and
    the unavailable ones are listed in the notes."""
    known = {v.name: v for v in VARIANTS}
    if names:
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; choose from {sorted(known)}")
        chosen = [known[n] for n in names]
        if validate is not None:
            for v in chosen:
                if (why := available(v, validate)) is not None:
                    raise ValueError(f"variant {v.name} is not available with this config: {why}")
        return chosen, []
    if validate is None:
        return list(VARIANTS), []
    chosen, notes = [], []
    for v in VARIANTS:
        why = available(v, validate)
        if why is None:
            chosen.append(v)
        else:
            notes.append(f"{v.name} left out (not available with this config: {why})")
    return chosen, notes


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
    successes: Optional[int] = None  # of the final evaluation
    episodes: Optional[int] = None
    initial: Optional[float] = None
    time_to_threshold_s: Optional[float] = None
    versions: Optional[int] = None
    admitted_frac: Optional[float] = None
    lag_max: Optional[int] = None  # the largest policy lag among trained trajectories (<= eta by design)
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)
    # what the loss saw, averaged over the second half of the run's versions (TensorBoard): whether the clip bound,
    # how far the behaviour policy was from the proximal one, and the policy's entropy per token
    clip_frac: Optional[float] = None
    behav_kl: Optional[float] = None
    entropy: Optional[float] = None


SIGNALS = {"clip_frac": ("loss/clip_frac_low", "loss/clip_frac_high"), "behav_kl": ("offpolicy/behav_kl",),
           "entropy": ("loss/entropy",)}


def training_signals(tb_dir: Path) -> dict[str, Optional[float]]:
    """``SIGNALS`` from a run's TensorBoard logs: each the mean over the second half of its logged versions (the
    sum of the tags for clip_frac); None for a signal whose tags are absent (tensorboard off)."""
    from async_vla.metrics import read_scalars

    out: dict[str, Optional[float]] = {}
    for name, tags in SIGNALS.items():
        series = [read_scalars(tb_dir, t) for t in tags]
        if not all(series):
            out[name] = None
            continue
        means = [statistics.fmean(v for _, v in pts[len(pts) // 2:]) for pts in series]
        out[name] = sum(means)
    return out


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
    final = s.get("final_eval") or {}
    res.final = final.get("success", s.get("final_eval_success"))
    res.successes, res.episodes = final.get("successes"), final.get("episodes")
    res.initial = s.get("initial_eval_success")
    res.time_to_threshold_s = time_to(s.get("eval") or [], threshold)
    res.versions = s.get("final_version")
    res.admitted_frac = groups.get("accepted", 0) / decided if decided else None
    res.lag_max = ledger.get("lag_max")
    res.extra["group_counts"] = dict(groups)
    for name, value in training_signals(Path(run_dir) / "tb").items():
        setattr(res, name, value)
    return res


def mean_interval(values: Sequence[float]) -> tuple[Optional[float], Optional[tuple[float, float]]]:
    """Mean and 95% Student-t interval over seeds (None for the interval with fewer than 2 values)."""
    if not values:
        return None, None
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, (max(0.0, m - half), min(1.0, m + half))


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{100 * v:.0f}%"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def _signal(v: Optional[float], pct: bool = False) -> str:
    if v is None:
        return "—"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def _pct_interval(iv: Optional[tuple[float, float]]) -> str:
    return "—" if iv is None else f"{100 * iv[0]:.0f}–{100 * iv[1]:.0f}%"


def table(results: Sequence[RunResult], threshold: float, budget: str, notes: Sequence[str] = ()) -> str:
    """Markdown: one row per variant, a cell over its seeds (final values; see the module docstring)."""
    by_variant: dict[str, list[RunResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    what = {v.name: v.what for v in VARIANTS}
    lines = ["| variant | what differs | seeds | final per seed | final mean (95% t over seeds) | pooled episodes "
             "(95% Wilson) | start | versions | groups admitted | max lag trained | clip frac | KL(behav‖prox) | "
             f"entropy | reached {threshold:.0%} |", "|" + "---|" * 14]
    for name, runs in by_variant.items():
        ok = [r for r in runs if r.error is None and r.final is not None]
        finals = [r.final for r in ok]
        m, iv = mean_interval(finals)
        succ = sum(r.successes for r in ok if r.successes is not None)
        eps = sum(r.episodes for r in ok if r.episodes is not None)
        pooled = f"{succ}/{eps} ({_pct_interval(wilson_interval(succ, eps))})" if eps else "—"
        reached = [r for r in ok if r.time_to_threshold_s is not None]
        twin = next((r.extra["same_as"] for r in runs if r.extra.get("same_as")), None)
        desc = what.get(name, "") + (f" (resolves to the same config as {twin}: its runs)" if twin else "")
        lines.append("| " + " | ".join([
            name, desc, str(len(runs)),
            " ".join(f"{100 * f:.0f}" for f in finals) or "—",
            f"{_fmt(m, True)} ({_pct_interval(iv)})", pooled, _fmt(_mean([r.initial for r in ok]), True),
            _fmt(_mean([r.versions for r in ok])), _fmt(_mean([r.admitted_frac for r in ok]), True),
            _fmt(max((r.lag_max for r in ok if r.lag_max is not None), default=None)),
            _signal(_mean([r.clip_frac for r in ok]), pct=True), _signal(_mean([r.behav_kl for r in ok])),
            _signal(_mean([r.entropy for r in ok])), f"{len(reached)}/{len(runs)}"]) + " |")
    errors = [r for r in results if r.error]
    out = [f"Budget {budget} per run; final held-out greedy success (the last evaluation, "
           f"at the budget); 'reached' counts runs whose evaluations ever reached {threshold:.0%} (a first "
           f"crossing, not a result). Clip frac (tokens whose PPO ratio the clip bound, both sides), KL(behaviour‖"
           f"proximal) and entropy per token: means over the second half of each run's versions, then over seeds."]
    out += [f"- {n}" for n in notes]
    out += [f"- {r.variant} seed {r.seed}: {r.error}" for r in errors]
    return "\n".join(lines + [""] + out)
