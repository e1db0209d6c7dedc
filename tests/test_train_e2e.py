"""End to end through bin/train: serial mode, and async with 2 learner ranks (ZeRO-3) + 2 actors + buffer;
then a real TensorBoard server reads a scalar back over HTTP."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from async_vla.hosts import free_port
from async_vla.metrics import read_scalars, read_tags
from tests.tb_helpers import missing_required

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "env.num_train_init_states=8", "env.num_eval_init_states=2", "buffer.groups_per_batch=2",
    "actor.group_size=4", "env.envs_per_actor=4", "learner.lr=1e-4", "transport.trajectory_port=0",
    "transport.control_port=0",
    "transport.batch_port=0", "transport.weights_port=0", "logging.status_every_s=2", "run.eval_every=2",
    "buffer.dynamic_sampling=false", "learner.micro_batch_trajectories=8",
]


def bin_train(tmp_path: Path, name: str, extra: list[str], timeout: int) -> tuple[subprocess.CompletedProcess, Path]:
    cfg = REPO / "configs" / "quickstart.yaml"
    argv = [sys.executable, str(REPO / "bin" / "train"), str(cfg), f"run.out_dir={tmp_path}", f"run.name={name}",
            *SMALL, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    proc.elapsed_s = time.monotonic() - started   # what every process of the run lived within
    return proc, tmp_path / name


def check_run_dir(rd: Path, proc: subprocess.CompletedProcess, versions: int, trained_from: int = 0) -> dict:
    """A finished run's directory; ``trained_from``: the version this part started at (its buffer's ledger)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["final_version"] >= versions
    assert summary["throughput"]["trajectories_per_s"] > 0 and summary["throughput"]["env_steps_per_s"] > 0
    for name in ("config.yaml", "success.png", "phases.png", "ledger.json"):
        assert (rd / name).is_file(), name
    check_phases(summary, rd, proc.elapsed_s)
    ledger = json.loads((rd / "ledger.json").read_text())
    counts = ledger["ledger"]
    assert ledger["received"] == sum(counts.values()), (ledger["received"], counts)
    assert counts["trained"] >= (versions - trained_from) * 2 * 4
    assert max((int(k) for k in ledger["lag_histogram"]), default=0) <= ledger["max_staleness"]
    return summary


OTHER_MAX_FRAC = 0.05   # the time no phase covers, per process kind


def check_phases(summary: dict, rd: Path, elapsed_s: float) -> None:
    """Where the time went: a table per process kind whose named phases add up to its wall time within a few percent
    ("other": what no phase covers), each kind's wall within what its processes can have lived (``elapsed_s``: the
    bin/train command's), and the shares in TensorBoard."""
    tables, tags = summary["phases"], read_tags(rd / "tb")
    assert set(tables) == {"actor", "learner", "buffer"}, tables
    for kind, table in tables.items():
        named = sum(s for name, s in table["seconds"].items() if name != "other")
        assert named >= (1 - OTHER_MAX_FRAC) * table["wall_s"], (kind, table)
        assert 0 < table["wall_s"] <= table["processes"] * elapsed_s, (kind, table, elapsed_s)
        assert any(t.startswith(f"time/{kind}/") for t in tags), kind


@pytest.mark.timeout(360)  # above the subprocess's own 300 s, so its budget (and message) applies
def test_serial_mode_end_to_end_and_a_resumed_run_reports_the_whole_run(tmp_path):
    proc, rd = bin_train(tmp_path, "serial", ["run.mode=serial", "run.max_versions=2"], timeout=150)
    first = check_run_dir(rd, proc, 2)
    tags = read_tags(rd / "tb")
    assert "eval/success_rate" in tags and "loss/policy" in tags
    assert [p["version"] for p in first["eval"]] == [0, 2] and first["resumed_at"] == []
    # --resume to version 4: summary.json and success.png cover both parts, the v2 eval is not repeated
    proc, _ = bin_train(tmp_path, "serial", ["run.mode=serial", "run.max_versions=4", "--resume"], timeout=150)
    whole = check_run_dir(rd, proc, 4, trained_from=2)
    assert [p["version"] for p in whole["eval"]] == [0, 2, 4] and whole["resumed_at"] == [2]
    assert whole["eval"][:2] == first["eval"] and whole["wall_s"] > first["wall_s"]
    assert whole["initial_eval_success"] == first["initial_eval_success"]


@pytest.mark.slow
@pytest.mark.timeout(620)
def test_async_two_learner_ranks_two_actors(tmp_path):
    proc, rd = bin_train(tmp_path, "async", [
        "run.mode=async", "run.max_versions=12", "learner.num_ranks=2", "actor.num_actors=2", "run.max_wall_s=400",
        "weights.verify_ranks=true",  # 12 versions: the first few go out before the actors have joined the group
    ], timeout=560)
    summary = check_run_dir(rd, proc, 12)
    # Periodic evals land on exactly the multiples of run.eval_every (the learner keeps those exports for the
    # launcher), between the initial eval of v0 and the final one; none are left on disk afterwards.
    evals = [p["version"] for p in summary["eval"]]
    assert evals[0] == 0 and evals[-1] == summary["final_version"] and len(evals) >= 3, evals
    assert all(v % 2 == 0 for v in evals[1:-1]) and evals == sorted(set(evals)), evals
    assert not (rd / "weights" / "milestones").exists()
    # After every broadcast both ZeRO-3 ranks' own gathers equal the checksum rank 0 sent, and every actor in
    # the group acknowledged only after its received tensors matched that checksum.
    ok = read_scalars(rd / "tb", "weights/rank_checksum_ok")
    assert len(ok) >= 13 and all(v == 1.0 for _, v in ok), ok  # v0 .. v12
    receivers = dict(read_scalars(rd / "tb", "weights/receivers"))
    confirmed = dict(read_scalars(rd / "tb", "weights/confirmed"))
    assert confirmed == receivers and max(receivers.values()) == 2, (receivers, confirmed)
    missing = missing_required(read_tags(rd / "tb"))
    assert not missing, f"TensorBoard tags missing: {missing}"
    commands = (rd / "commands.txt").read_text()
    assert "bin/buffer" in commands and "bin/learner" in commands and "bin/actors" in commands
    for log in ("buffer.log", "learner.log", "actors.log"):
        assert (rd / "logs" / log).is_file()


@pytest.mark.slow
@pytest.mark.timeout(460)
def test_sync_mode_trains_every_version_on_fresh_data(tmp_path):
    # Sync (eta = 0): each version waits for rollouts of the previous one. The actor joins the weight broadcast
    # after v1 went out (the learner steps as soon as the first batch lands), so this also covers the actor
    # catching up from the exported weights; without it the run deadlocked at v1 with every trajectory stale.
    # Over ipc:// socket files (transport.use_ipc) instead of tcp: the launcher, buffer and actors must agree.
    proc, rd = bin_train(tmp_path, "sync", ["run.mode=sync", "run.max_versions=4", "run.max_wall_s=200",
                                            "transport.use_ipc=true"], timeout=400)
    check_run_dir(rd, proc, 4)
    assert (rd / "sockets" / "trajectory").exists() and (rd / "sockets" / "control").exists()
    ledger = json.loads((rd / "ledger.json").read_text())
    assert ledger["max_staleness"] == 0 and set(ledger["lag_histogram"]) == {"0"}
    assert ledger["ledger"]["stale"] <= 2 * 4  # at most the groups in flight when a version lands


def test_tensorboard_server_serves_a_scalar(tmp_path):
    from async_vla.metrics import Monitor

    mon = Monitor(tmp_path)
    for step in range(3):
        mon.scalar("eval/success_rate", 0.25 * step, step)
    mon.close()
    port = free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "tb"), "--host",
                           "127.0.0.1", "--port", str(port), "--load_fast=false"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        values = None
        while time.time() < deadline:
            try:
                runs = json.loads(urllib.request.urlopen(f"{base}/data/runs", timeout=5).read())
                if runs:
                    q = urllib.parse.urlencode({"run": runs[0], "tag": "eval/success_rate"})
                    values = json.loads(urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{q}",
                                                               timeout=5).read())
                    if len(values) == 3:
                        break
            except OSError:
                pass
            time.sleep(1)
        assert values is not None and [v[1] for v in values] == [0, 1, 2]
        assert values[2][2] == pytest.approx(0.5)
    finally:
        tb.terminate()
        try:
            tb.wait(20)
        except subprocess.TimeoutExpired:
            tb.kill()
            tb.wait(10)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes_mentioning(text: str) -> list[int]:
    pids = (int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit())
    return [pid for pid in pids if text in _cmdline(pid)]


def _kill_run(launcher: subprocess.Popen, rd: Path) -> None:
    """Whatever a test left running: the launcher and every process of its run directory."""
    if launcher.poll() is None:
        launcher.kill()
    for pid in _processes_mentioning(str(rd)):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever adopted it, maybe later)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_killed_launcher_takes_its_children_along(tmp_path):
    """kill -9 of bin/train (OOM killer, a scheduler's hard stop): buffer, learner ranks and actors get SIGTERM
    from the kernel (PR_SET_PDEATHSIG) and stop as on Ctrl-C - the learner with a final checkpoint - instead of
    running on as orphans holding ports and cores."""
    cfg = REPO / "configs" / "quickstart.yaml"
    rd = tmp_path / "k9"
    argv = [sys.executable, str(REPO / "bin" / "train"), str(cfg), f"run.out_dir={tmp_path}", "run.name=k9", *SMALL,
            "run.mode=async", "run.max_versions=100000", "run.max_wall_s=250", "learner.num_ranks=2"]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 150
        while not (rd / "weights" / "latest").exists():   # the learner published: every child is up
            assert launcher.poll() is None and time.monotonic() < deadline, "bin/train did not get going"
            time.sleep(0.5)
        children = [p for p in _processes_mentioning(str(rd)) if p != launcher.pid]
        assert len(children) >= 5, children   # buffer, bin/learner + 2 ranks, fleet (+ its actor)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 90
        while (left := [p for p in children if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"orphans still running: {left}"
        assert "stopped at version" in (rd / "logs" / "learner.log").read_text()   # a clean stop, checkpointed
    finally:
        _kill_run(launcher, rd)


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_bin_train_starts_a_killed_buffer_again_and_the_run_finishes(tmp_path):
    cfg = REPO / "configs" / "quickstart.yaml"
    rd = tmp_path / "bufkill"
    argv = [sys.executable, str(REPO / "bin" / "train"), str(cfg), f"run.out_dir={tmp_path}", "run.name=bufkill",
            *SMALL, "run.mode=async", "run.max_versions=12", "run.max_wall_s=250"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 150
        while not (rd / "weights" / "latest").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "bin/train did not get going"
            time.sleep(0.5)
        buffers = [p for p in _processes_mentioning(str(rd)) if "bin/buffer" in _cmdline(p)]
        assert len(buffers) == 1, buffers
        os.kill(buffers[0], 9)
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    assert "starting it again (1/3" in out, out[-3000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["final_version"] >= 12 and not summary["failed"]
    starts = (rd / "logs" / "buffer.log").read_text().count("buffer: trajectories on")
    assert starts == 2, starts                        # the killed one and the one started again, on the same log


@pytest.mark.slow
@pytest.mark.timeout(360)   # the hang guard: the loops below wait on the launcher's progress, not on a clock
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_second_ctrl_c_ends_bin_train_at_once_and_leaves_nothing_running(tmp_path):
    """Ctrl-C starts the clean stop (actors first, then the learner's final checkpoint, the buffer, a final
    evaluation); a second one, sent once the actors are gone, while the launcher waits on the rest, ends bin/train
    with 130, no summary and a message naming what to do - and no child is left running when it has exited
    (before, it exited while the learner went on writing into the run directory and the buffer held its ports)."""
    cfg = REPO / "configs" / "quickstart.yaml"
    rd = tmp_path / "cc"
    argv = [sys.executable, str(REPO / "bin" / "train"), str(cfg), f"run.out_dir={tmp_path}", "run.name=cc",
            *SMALL, "run.mode=async", "run.max_versions=100000", "run.max_wall_s=250"]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        while not (rd / "weights" / "latest").exists():   # the learner published: every child is up
            assert launcher.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.5)
        children = [p for p in _processes_mentioning(str(rd)) if p != launcher.pid]
        actors = [p for p in children if "bin/actors" in _cmdline(p)]
        assert len(children) >= 3 and len(actors) == 1, [_cmdline(p) for p in children]
        launcher.send_signal(signal.SIGINT)
        while _running(actors[0]) and launcher.poll() is None:   # the clean stop has begun with the actors
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        launcher.wait()
        left = [(p, _cmdline(p)) for p in children if _running(p)]
    finally:
        _kill_run(launcher, rd)
    text = err_path.read_text()
    assert launcher.returncode == 130, text[-3000:]
    assert "SIGINT: stopping cleanly" in text and "interrupted: no final evaluation or summary" in text, text[-3000:]
    assert not left, f"still running after bin/train exited: {left}"
    assert not (rd / "summary.json").exists()
