"""``bin/gpu-check``: the first command on a GPU host (docs/GPU.md "bin/gpu-check"): ``gpu`` tests, torch vs vLLM
log-probs, an NCCL broadcast per tensor vs bucketed (2 GPUs), and with ``policy.path`` one LIBERO episode, a row
each; ``--scale`` measures the 7.5 B shape (runner/gpu_scale.py). Without CUDA it says nothing was checked and
returns 1."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
BUCKET_BYTES = 64 * 2**20
# A gpu mark as a decorator or a module-wide ``pytestmark`` (not the words in a string or a comment).
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.MULTILINE)
NO_GPU = ("bin/gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing was checked. "
          "Run it on a GPU host after `pip install -e '.[gpu,dev]'` (README \"GPU install\").")


@dataclass
class Row:
    check: str
    status: str          # ok, FAIL, skipped
    detail: str


def table(rows: Sequence[Row]) -> str:
    """Plain-text table, one row per check."""
    widths = [max(len(h), *(len(getattr(r, f)) for r in rows)) for h, f in
              (("check", "check"), ("status", "status"), ("detail", "detail"))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(("check", "status", "detail"), widths)), line]
    out += ["  ".join(v.ljust(w) for v, w in zip((r.check, r.status, r.detail), widths)) for r in rows]
    return "\n".join(out)


def _pytest(args: list[str], timeout_s: float) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args]
    try:
        done = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "FAIL", f"timed out after {timeout_s:.0f} s"
    summary = next((ln.strip("= ") for ln in reversed(done.stdout.splitlines()) if re.search(r"\d+ (passed|failed|"
                                                                                           r"skipped|error)", ln)),
                   done.stdout[-200:] or done.stderr[-200:])
    if done.returncode == 5:
        return "skipped", "no tests collected"
    if done.returncode != 0:
        return "FAIL", summary
    return ("skipped" if "passed" not in summary else "ok"), summary


def gpu_test_files(tests_dir: Path = REPO / "tests", root: Path = REPO) -> list[str]:
    """The test files that hold a ``gpu``-marked test. Collecting only these keeps the check independent of the
    rest of the suite's dependencies (a GPU host without the dev extra's Ray would otherwise fail collecting
    tests/test_ray_launcher.py) and of its collection time."""
    return sorted(str(f.relative_to(root)) for f in tests_dir.rglob("test_*.py")
                  if GPU_MARK.search(f.read_text(encoding="utf-8")))


def gpu_tests() -> Row:
    files = gpu_test_files()
    if not files:
        return Row("gpu tests (pytest -m gpu)", "FAIL", "no test file under tests/ is marked gpu")
    status, detail = _pytest(["-m", "gpu", *files], 1800)
    return Row("gpu tests (pytest -m gpu)", status, f"{detail} ({len(files)} files)")


def vllm_agreement() -> Row:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return Row("torch vs vLLM log-probs", "skipped", "vLLM not installed (the gpu extra installs it)")
    status, detail = _pytest(["-m", "gpu", "tests/test_vllm_backend.py"], 1200)
    return Row("torch vs vLLM log-probs", status, detail)


def layer_like_sizes(layers: int = 8, hidden: int = 4096) -> list[int]:
    """Element counts of a transformer-shaped weight set: per layer 4 h x h matrices, 3 h x 2.7h and 2 norms."""
    per = [hidden * hidden] * 4 + [hidden * (hidden * 27 // 10)] * 3 + [hidden] * 2
    return per * layers


def _buckets(sizes: Sequence[int], elem_bytes: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if out[-1] and used + n * elem_bytes > BUCKET_BYTES:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n * elem_bytes
    return out


def _nccl_rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, result) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    groups = _buckets(sizes, 2)
    flats = [torch.empty(sum(sizes[i] for i in g), device="cuda", dtype=torch.bfloat16) for g in groups]

    def per_tensor() -> None:
        for t in tensors:
            dist.broadcast(t, 0)

    def bucketed() -> None:
        for g, flat in zip(groups, flats):
            if rank == 0:
                torch.cat([tensors[i] for i in g], out=flat)
            dist.broadcast(flat, 0)
            if rank != 0:
                off = 0
                for i in g:
                    tensors[i].copy_(flat[off:off + sizes[i]])
                    off += sizes[i]

    def timed(fn) -> float:
        times = []
        for k in range(repeats + 1):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if k:                       # the first is a warm-up (NCCL communicator set-up)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    per, buck = timed(per_tensor), timed(bucketed)
    if rank == 0:
        nbytes = sum(sizes) * 2
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copies = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        result.update(bytes=nbytes, tensors=len(sizes), buckets=len(groups), per_tensor_s=per, bucketed_s=buck,
                      copy_s=statistics.median(copies))
    dist.destroy_process_group()


def nccl_benchmark(repeats: int = 5) -> list[Row]:
    import torch
    import torch.multiprocessing as mp

    from async_vla.hosts import free_port

    if torch.cuda.device_count() < 2:
        return [Row("NCCL broadcast", "skipped", f"needs 2 GPUs, this host has {torch.cuda.device_count()} "
                                                 "(NCCL cannot run two ranks on one device)")]
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_nccl_rank, args=(2, free_port(), layer_like_sizes(), repeats, result), nprocs=2, join=True)
        r = dict(result)
    gb = r["bytes"] / 1e9
    copy_gbps = gb / r["copy_s"]
    rows = []
    for name, key in (("per tensor", "per_tensor_s"), ("bucketed 64 MiB", "bucketed_s")):
        gbps = gb / r[key]
        rows.append(Row(f"NCCL broadcast, {name}", "ok",
                        f"{gb:.2f} GB in {r[key] * 1e3:.1f} ms: {gbps:.1f} GB/s = {gbps / copy_gbps:.0%} of the "
                        f"device copy ({copy_gbps:.0f} GB/s); {r['tensors']} tensors, {r['buckets']} buckets; "
                        f"median of {repeats}"))
    return rows


def libero_episode(config: Optional[str], overrides: list[str]) -> Row:
    path = next((o.split("=", 1)[1] for o in overrides if o.startswith("policy.path=")), None)
    if path is None:
        return Row("greedy LIBERO episode", "skipped", "give policy.path=<checkpoint> (and a config) to run one")
    cmd = [sys.executable, str(REPO / "bin" / "eval"), path] + ([config] if config else []) + \
          [o for o in overrides if not o.startswith("policy.path=")] + \
          ["env.task_ids=[0]", "env.num_eval_init_states=1", "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return Row("greedy LIBERO episode", "FAIL", (done.stderr.strip().splitlines() or ["bin/eval failed"])[-1])
    import json

    res = json.loads(done.stdout)
    return Row("greedy LIBERO episode", "ok", f"task 0, one held-out init state: success {res['success_rate']:.0f} "
                                              f"({res['episodes']} episode, {time.perf_counter() - t0:.0f} s with "
                                              "start-up)")


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="bin/gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="YAML config for the LIBERO episode (e.g. configs/libero_spatial.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides; policy.path=<checkpoint> runs the episode")
    ap.add_argument("--skip-tests", action="store_true", help="only the benchmark and the episode")
    ap.add_argument("--scale", action="store_true", help="measure an OpenVLA-OFT-shaped model instead (gpu_scale.py)")
    ap.add_argument("--size", choices=("7b", "tiny"), default="7b", help="--scale: the model's size (tiny: CPU too)")
    ap.add_argument("--doc", type=Path, default=None,
                    help="--scale: write the table into this file's marked block (default docs/GPU.md for 7b)")
    args = ap.parse_intermixed_args(argv)
    if args.scale:
        return scale(args.size, args.doc if args.doc is not None or args.size != "7b" else REPO / "docs" / "GPU.md")
    if args.config and "=" in args.config:       # only overrides given
        args.overrides.insert(0, args.config)
        args.config = None
    import torch

    if not torch.cuda.is_available():
        from runner.preflight import cuda_driver_problem, host_cuda

        why = cuda_driver_problem(*host_cuda())
        print(NO_GPU + (f"\n[gpu-check] {why}" if why else ""), file=sys.stderr)
        return 1
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"[gpu-check] {torch.cuda.device_count()} GPU(s): {names}; torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}", flush=True)
    rows: list[Row] = []
    if not args.skip_tests:
        rows += [gpu_tests(), vllm_agreement()]
    try:
        rows += nccl_benchmark()
    except Exception as exc:    # a failed benchmark is a row of the table, not the end of the check
        rows.append(Row("NCCL broadcast", "FAIL", f"{type(exc).__name__}: {exc}"))
    rows.append(libero_episode(args.config, args.overrides))
    print(table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def scale(size: str, doc: Optional[Path]) -> int:
    """``--scale``: the table of runner/gpu_scale.py on this host's GPU (or the CPU for the tiny size)."""
    import tempfile

    import torch

    from runner.gpu_scale import run_scale, table, write_into_doc

    if torch.cuda.is_available():
        device = "cuda"
    elif size == "tiny":
        device = "cpu"
    else:
        print(NO_GPU, file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        rows, facts = run_scale(size, device, Path(work))
    text = table(rows, facts)
    print(text)
    if doc is not None:
        write_into_doc(doc, text)
        print(f"[gpu-check] table written into {doc}")
    return 1 if any(r["value"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
