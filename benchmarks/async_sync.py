"""P1: async vs sync throughput at equal settings (bin/train section "async").

Both modes run the same config through bin/train with run.pin_cores=true: learner + buffer on one core,
the actor fleet on the other. Throughput is measured from the learner's TensorBoard events between the
first and the last policy version (process start-up excluded): versions/s and trained trajectories/s.
In sync mode (η = 0) the actors idle while the learner steps and vice versa, so the ideal async speed-up
with one core each is 2.0× when both sides are equally busy; the sync run's phases (``summary.json``) give the
ideal for the policy at hand, (actor + learner busy) / the busier one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import md_table

REPO = Path(__file__).resolve().parent.parent


def version_wall_times(tb_dir: Path) -> list[tuple[int, float]]:
    """(version, wall time) of every ``weights/version`` event the learner wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if "weights/version" in acc.Tags().get("scalars", []):
            out += [(int(e.value), e.wall_time) for e in acc.Scalars("weights/version")]
    return sorted(set(out))


def run_mode(mode: str, out_dir: Path, versions: int, extra: list[str]) -> dict:
    argv = [sys.executable, str(REPO / "bin" / "train"), str(REPO / "configs" / "quickstart.yaml"),
            f"run.mode={mode}", f"run.name={mode}", f"run.out_dir={out_dir}", f"run.max_versions={versions}",
            "run.pin_cores=true", "run.eval_every=0", "run.max_wall_s=900", "run.target_success=null",
            "transport.trajectory_port=0", "transport.control_port=0",
            "transport.batch_port=0", "transport.weights_port=0", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=1200,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    rd = out_dir / mode
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = version_wall_times(rd / "tb")
    ledger = json.loads((rd / "ledger.json").read_text())["ledger"]
    phases = json.loads((rd / "summary.json").read_text()).get("phases", {})
    (v0, t0), (v1, t1) = times[0], times[-1]
    span = max(t1 - t0, 1e-9)
    return {"mode": mode, "versions_timed": v1 - v0, "seconds": span, "versions_per_s": (v1 - v0) / span,
            "trained_per_s": ledger["trained"] * (v1 - v0) / max(v1, 1) / span, "ledger": ledger,
            "busy_s": {kind: busy_seconds(phases, kind) for kind in WAITING}}


WAITING = {"actor": ("wait_grant", "startup"), "learner": ("wait_batch", "startup")}


def busy_seconds(phases: dict, kind: str) -> float:
    """Seconds the processes of ``kind`` spent working (``summary.json`` ``phases``): their wall time less waiting
    for the other side and starting up."""
    p = phases.get(kind, {})
    return sum(v for k, v in p.get("seconds", {}).items() if k not in WAITING[kind])


def ideal_overlap(busy: dict) -> float:
    """The async / sync speed-up that full overlap of actors and learner would give, from a sync run's busy
    seconds: in sync mode they take turns (actor + learner per version), in async mode the slower one sets the pace."""
    a, l = busy["actor"], busy["learner"]
    return (a + l) / max(a, l, 1e-9)


def sft_checkpoint(out: Path) -> Path:
    """The quickstart's one-demo SFT start: a random policy almost never succeeds, every group would be
    filtered as uniform and neither mode would make versions, so both modes start from the same SFT weights."""
    subprocess.run([sys.executable, str(REPO / "bin" / "sft"), str(REPO / "configs" / "quickstart.yaml"),
                    "--demos", "1", "--out", str(out)], check=True, capture_output=True, cwd=REPO,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out


def run(quick: bool = False) -> dict:
    versions = 8 if quick else 60
    # Dynamic sampling off: every group is trained, so versions/s measures the system, not how the learning
    # happens to go (with it on, a run whose policy drifts to uniform outcomes makes fewer versions per second).
    extra = ["buffer.dynamic_sampling=false"] + ([] if not quick else ["env.num_eval_init_states=2"])
    with tempfile.TemporaryDirectory() as tmp:
        extra.append(f"policy.path={sft_checkpoint(Path(tmp) / 'sft')}")
        res = {m: run_mode(m, Path(tmp), versions, extra) for m in ("sync", "async")}
    ratio = res["async"]["versions_per_s"] / res["sync"]["versions_per_s"]
    ideal = ideal_overlap(res["sync"]["busy_s"])
    rows = [[m, r["versions_timed"], r["seconds"], r["versions_per_s"], r["trained_per_s"], r["ledger"]["stale"],
             r["ledger"]["filtered_uniform"]] for m, r in res.items()]
    md = (f"Learner + buffer pinned to one core, actors to the other; same config (configs/quickstart.yaml) and the "
          f"same one-demo SFT start, {versions} versions each, dynamic sampling off (every group trained).\n"
          f"**async / sync = {ratio:.2f}x** in versions per second (goal >= 1.8x; 2.0x with actors and learner "
          f"equally busy). The sync run's phases give the ideal for this policy: actors busy "
          f"{res['sync']['busy_s']['actor']:.0f} s, learner {res['sync']['busy_s']['learner']:.0f} s, so full overlap "
          f"gives **{ideal:.2f}x** (measured / ideal = {ratio / ideal:.0%}).\n\n"
          + md_table(["mode", "versions timed", "seconds", "versions/s", "trained traj/s", "stale", "uniform"], rows))
    return {"section": "async", "results": {"modes": res, "async_over_sync": ratio, "ideal_from_phases": ideal},
            "markdown": md}
