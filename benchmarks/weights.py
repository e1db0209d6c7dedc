"""Benchmark "weights": broadcast of ~10M / ~100M fp32 parameters to 2 actor processes, per-tensor vs bucketed.

All modes run through the same ``WeightPublisher.publish`` path (the same gloo group over loopback,
receivers acknowledge once they hold the version), differing only in the bucket cap, whether ops overlap, whether
the checksum is computed and checked, and whether the native packing kernel is used:
  * per-tensor naive: cap ~0, every tensor its own broadcast (sent from the tensor itself, no copy),
    waiting for each before the next - the usual ``for p in params: broadcast(p)`` loop;
  * per-tensor overlapped: the same, but all broadcasts issued before waiting;
  * bucketed (the default): cap = weights.bucket_mb (default 16 MiB), tensors copied into flat typed buckets first
    (the native kernel sums while it copies), overlapped; "verify off" and "packed with torch" vary it.
Times per publish: *end to end* runs from the start of the publish until the learner is free again (its
``sync_s``: pack + checksum + broadcast + acknowledgements) *and* both receivers hold the version (their
``poll()`` returned) - the broadcast time; *learner's cost* is ``sync_s`` alone; *broadcast phase* is end to end
minus packing and checksum; *into both models* runs until both receivers have also copied the version into
their own model tensors (what an actor's ``load_state_dict`` does between chunks). All stamps are the host's
CLOCK_MONOTONIC. Export to disk is off. The model is transformer-shaped (many small bias/norm tensors beside large
matrices). Single-core memcpy bandwidth is measured in the same run: the goal's yardstick is a 256 MiB copy (libc
switches to non-temporal stores there: its peak), sampled once per round of publishes and taken as the median of a
size's own rounds (the machine's memory bandwidth drifts by ~20% from minute to minute; the figure from before the
run is reported too), and for context one copy of the model's own bytes (below ~190 MB libc copies through the
cache, slower). "of memcpy" = bytes per second delivered to each receiver / memcpy bytes per second. Timed
publishes alternate the modes (each mode publishes twice in a row, the second is timed); medians are reported.
This benchmark starts its own receiver processes (spawn), as a benchmark must.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from async_vla.weights import native
from async_vla.config import Config
from async_vla.weights.buckets import checksum
from benchmarks.common import memcpy_gbps

GOAL_SPEEDUP = 1.5
GOAL_MEMCPY_FRAC = 0.5
WARMUP = 4


def synthetic_model(n_params: int) -> list[tuple[str, torch.Tensor]]:
    """Embedding + L transformer layers (12 h^2 + 13 h params each) sized to ~n_params."""
    h = 256 if n_params < 30e6 else 768
    vocab = 8192 if h == 256 else 16384
    layers = max(1, round((n_params - vocab * h) / (12 * h * h + 13 * h)))
    out = [("embed.weight", torch.randn(vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attn.qkv.weight", torch.randn(3 * h, h)), (p + "attn.qkv.bias", torch.randn(3 * h)),
                (p + "attn.o.weight", torch.randn(h, h)), (p + "attn.o.bias", torch.randn(h)),
                (p + "mlp.up.weight", torch.randn(4 * h, h)), (p + "mlp.up.bias", torch.randn(4 * h)),
                (p + "mlp.down.weight", torch.randn(h, 4 * h)), (p + "mlp.down.bias", torch.randn(h)),
                (p + "norm1.weight", torch.ones(h)), (p + "norm2.weight", torch.ones(h))]
    out.append(("norm.weight", torch.ones(h)))
    return out


class _Yardstick:
    """Single-core libc memcpy of 256 MiB (``np.copyto``, as ``memcpy_gbps``), sampled once per round of publishes:
    this machine's memory bandwidth drifts by ~20% from one minute to the next, so each size is judged against the
    median of the samples taken while its own publishes ran, not against one figure from before them."""

    def __init__(self, nbytes: int = 256 * 2**20):
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)          # (pages faulted in here, not in a sample)
        self.samples: list[float] = []

    def sample(self) -> None:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.samples.append(self.src.nbytes / (time.perf_counter() - t0) / 1e9)

    def take(self) -> list[float]:
        out, self.samples = self.samples, []
        return out


def torch_copy_gbps(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Single-core ``Tensor.copy_`` bandwidth, best of ``repeats`` (for context: packing copies with it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
        return nbytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _receiver(run_dir: str, port: int, actor_id: int, ready, loaded) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from async_vla.weights import WeightSubscriber

    cfg = _config()
    sub = WeightSubscriber(cfg, actor_id, run_dir, "127.0.0.1", port)
    ready.put(actor_id)
    parent = os.getppid()
    model: dict[str, torch.Tensor] = {}
    while os.getppid() == parent:
        got = sub.poll(timeout=0.5)
        if got is None:
            continue
        got_at = time.monotonic()         # the actor holds the version: what a broadcast must achieve
        _load(model, got[1])
        loaded.put((actor_id, got[0].version, got_at, time.monotonic()))
        del got                           # let go of the received version, as an actor does


def _load(model: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """What load_state_dict does: copy into the model's own tensors (a function, so no view outlives it)."""
    for name, t in tensors.items():
        if name not in model or model[name].shape != t.shape or model[name].dtype != t.dtype:
            model[name] = torch.empty_like(t)
        model[name].copy_(t)


def _config() -> Config:
    cfg = Config()
    cfg.transport.weights_port = 0
    cfg.weights.export = False
    cfg.weights.verify = True      # the default: the learner sums, receivers check (a mode turns both off)
    cfg.weights.timeout_s = 120.0
    cfg.weights.join_timeout_s = 10.0
    return cfg


def run(quick: bool = False) -> dict:
    from async_vla.weights import WeightPublisher

    sizes = [10_000_000] if quick else [10_000_000, 100_000_000]
    repeats = {10_000_000: 3 if quick else 7, 100_000_000: 7}
    torch.set_num_threads(1)
    # The yardstick is libc memcpy (np.copyto, 256 MiB: the transport bench's): ~1.7x what Tensor.copy_ reaches
    # on this machine at that size (non-temporal stores), so a figure against copy_ would flatter us.
    memcpy, torch_copy = memcpy_gbps(), torch_copy_gbps()
    yard = _Yardstick()
    ctx = mp.get_context("spawn")
    ready, loaded = ctx.Queue(), ctx.Queue()
    results: dict = {"memcpy_start_gbps": round(memcpy, 2), "torch_copy_gbps": round(torch_copy, 2), "receivers": 2,
                     "pack_kernel": native.status(),
                     "transport": "gloo tcp loopback",
                     "bucket_mb": Config().weights.bucket_mb, "load_avg_1m": os.getloadavg()[0], "sizes": {}}
    with tempfile.TemporaryDirectory() as run_dir:
        pub = WeightPublisher(_config(), run_dir)
        procs = [ctx.Process(target=_receiver, args=(run_dir, pub.port, i, ready, loaded), daemon=True)
                 for i in (1, 2)]
        try:
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=120)
            if pub.wait_for_actors(2, 60) < 2:
                raise RuntimeError("receivers did not register")
            version = 0
            for n in sizes:
                model = synthetic_model(n)
                nbytes = sum(t.numel() * t.element_size() for _, t in model)
                cap = Config().weights.bucket_mb
                # (bucket cap, overlap, verify)
                modes = {"per_tensor_naive": (1e-6, False, True), "per_tensor": (1e-6, True, True),
                         "bucketed": (cap, True, True), "bucketed_nocheck": (cap, True, False),
                         "bucketed_torch": (cap, True, True)}     # no native library: Tensor.copy_ packing
                times: dict[str, list[float]] = {m: [] for m in modes}
                bcast: dict[str, list[float]] = {m: [] for m in modes}
                learner: dict[str, list[float]] = {m: [] for m in modes}
                into: dict[str, list[float]] = {m: [] for m in modes}
                # Warm-up rounds (untimed): the manifest, page faults. Within a round each mode publishes twice and
                # only the second is timed: a learner keeps its settings, and a publish right after another mode ran
                # into caches that mode had just filled (TCP copies).
                for r in range(repeats[n] + WARMUP):
                    if r >= WARMUP:
                        yard.sample()
                    order = list(modes) if r % 2 == 0 else list(reversed(modes))
                    for mode, timed in ((m, k == 1) for m in order for k in (0, 1)):
                        pub.cfg.bucket_mb, pub.cfg.overlap, pub.cfg.verify = modes[mode]
                        version += 1
                        t0 = time.monotonic()
                        with _torch_packing(mode == "bucketed_torch"):
                            st = pub.publish(version, model)
                        if st["confirmed"] != 2:
                            raise RuntimeError(f"publish not confirmed by both receivers: {st}")
                        if st["transport"] != "gloo":
                            raise RuntimeError(f"{mode} went over {st['transport']!r}")
                        held, done = _loaded(loaded, version)
                        if r >= WARMUP and timed:
                            # Done when the learner is free again and both receivers hold the version.
                            end = max(st["sync_s"], max(held) - t0)
                            times[mode].append(end)
                            learner[mode].append(st["sync_s"])
                            bcast[mode].append(end - st["pack_s"])
                            into[mode].append(max(done) - t0)
                samples = yard.take()
                memcpy = statistics.median(samples)     # the yardstick of this size: sampled during its rounds
                med = {m: statistics.median(v) for m, v in times.items()}
                gbps = nbytes / med["bucketed"] / 1e9
                same = memcpy_gbps(nbytes)     # copying these very bytes once (below ~190 MB: cached stores)
                bcast_gbps = nbytes / statistics.median(bcast["bucketed"]) / 1e9
                into_s = {m: statistics.median(v) for m, v in into.items()}
                t_ck = min(_timed(lambda: checksum(model)) for _ in range(2))
                results["sizes"][f"{n // 1_000_000}M"] = {
                    "params": sum(t.numel() for _, t in model), "tensors": len(model), "bytes": nbytes,
                    "memcpy_gbps": memcpy, "memcpy_samples_gbps": [round(x, 2) for x in samples],
                    "per_tensor_naive_s": med["per_tensor_naive"], "per_tensor_s": med["per_tensor"],
                    "bucketed_s": med["bucketed"], "bucketed_broadcast_only_s": statistics.median(bcast["bucketed"]),
                    "speedup_vs_naive": med["per_tensor_naive"] / med["bucketed"],
                    "speedup": med["per_tensor"] / med["bucketed"],
                    "bucketed_gbps_per_receiver": gbps, "bucketed_gbps_aggregate": 2 * gbps,
                    "frac_of_memcpy": gbps / memcpy, "checksum_gbps": nbytes / t_ck / 1e9,
                    "memcpy_same_bytes_gbps": same, "frac_of_memcpy_same_bytes": gbps / same,
                    "bucketed_learner_s": statistics.median(learner["bucketed"]),
                    "broadcast_only_gbps_per_receiver": bcast_gbps,
                    "broadcast_only_frac_of_memcpy": bcast_gbps / memcpy,
                    "into_models_s": into_s, "into_models_frac_of_memcpy": nbytes / into_s["bucketed"] / 1e9 / memcpy,
                    "into_models_speedup": into_s["per_tensor"] / into_s["bucketed"],
                    "bucketed_nocheck_s": med["bucketed_nocheck"], "bucketed_torch_pack_s": med["bucketed_torch"],
                    "torch_pack_frac_of_memcpy": nbytes / med["bucketed_torch"] / 1e9 / memcpy,
                    "nocheck_frac_of_memcpy": nbytes / med["bucketed_nocheck"] / 1e9 / memcpy,
                    "nocheck_into_models_frac_of_memcpy": nbytes / into_s["bucketed_nocheck"] / 1e9 / memcpy,
                    "samples": {m: [round(x, 4) for x in v] for m, v in times.items()},
                }
                del model
        finally:
            for p in procs:   # receivers first: closing the publisher's store under them makes c10d log errors
                if p.is_alive():
                    p.kill()
                p.join(5)
            pub.close()
    return {"section": "weights", "results": results, "markdown": _markdown(results)}


@contextlib.contextmanager
def _torch_packing(on: bool):
    """The learner packs without the native kernel (as where it is not built); receivers are unchanged."""
    if not on:
        yield
        return
    load = native._load
    native._load = lambda: (None, "switched off by the benchmark")
    try:
        yield
    finally:
        native._load = load


def _loaded(loaded, version: int, timeout_s: float = 60.0) -> tuple[list[float], list[float]]:
    """Wait until both receivers report ``version`` copied into their models; their CLOCK_MONOTONIC stamps of
    when they held it (``poll()`` returned) and of when the copy was done."""
    stamps: dict[int, tuple[float, float]] = {}
    end = time.monotonic() + timeout_s
    while len(stamps) < 2:
        actor, v, held, done = loaded.get(timeout=max(0.01, end - time.monotonic()))
        if v == version:
            stamps[actor] = (held, done)
    return [h for h, _ in stamps.values()], [d for _, d in stamps.values()]


def _markdown(res: dict) -> str:
    yard = "; ".join(f"{k}: {r['memcpy_gbps']:.2f} GB/s (median of {len(r['memcpy_samples_gbps'])} samples "
                     f"{min(r['memcpy_samples_gbps']):.1f}-{max(r['memcpy_samples_gbps']):.1f})"
                     for k, r in res["sizes"].items())
    lines = [f"Broadcast to {res['receivers']} receiver processes on this host over gloo (TCP loopback), buckets of "
             f"{res['bucket_mb']:g} MiB; single-core memcpy (libc, 256 MiB) sampled once per round while each size "
             f"ran - {yard}; before the run {res['memcpy_start_gbps']:.2f} GB/s (Tensor.copy_ "
             f"{res.get('torch_copy_gbps', float('nan')):.2f} GB/s; 1-min load average {res['load_avg_1m']:.1f} at "
             "start). Default settings (weights.verify on: the learner computes the checksum while packing, the "
             "receivers check it before taking the version) except the 'verify off' column; 'packed with torch' is "
             "the default where the native library is not built (Tensor.copy_, sums on a helper thread). Medians of "
             "one publish: end to end = from the start of the publish until the learner is free again and both "
             "receivers hold the version (their poll() returned); learner's cost = the publish call alone; "
             "broadcast phase = end to end minus pack and checksum; into both models = until both receivers have "
             "also copied it into their own model tensors (what an actor's load does between chunks). GB/s are per "
             f"receiver. Goals: bucketed >= {GOAL_SPEEDUP}x per-tensor, >= {GOAL_MEMCPY_FRAC:.0%} of memcpy (end to "
             "end).", "",
             "| model | MB | per-tensor naive s | per-tensor overlapped s | bucketed s | "
             "speedup vs naive, vs overlapped | end to end: GB/s, of memcpy | of memcpy of the same bytes | "
             "learner's cost s | verify off: s, of memcpy | packed with torch: s, of memcpy | "
             "broadcast phase s | into both models: per-tensor s, bucketed s, of memcpy (verify off) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def goal(x: float, target: float) -> str:
        return "meets" if x >= target else "misses"

    for name, r in res["sizes"].items():
        into = r["into_models_s"]
        lines.append(f"| {name} ({r['params'] / 1e6:.1f}M fp32, {r['tensors']} tensors) | {r['bytes'] / 1e6:.0f} | "
                     f"{r['per_tensor_naive_s']:.3f} | {r['per_tensor_s']:.3f} | {r['bucketed_s']:.3f} | "
                     f"{r['speedup_vs_naive']:.2f}x, {r['speedup']:.2f}x "
                     f"({goal(min(r['speedup'], r['speedup_vs_naive']), GOAL_SPEEDUP)} goal) | "
                     f"{r['bucketed_gbps_per_receiver']:.2f}, {r['frac_of_memcpy']:.0%} "
                     f"({goal(r['frac_of_memcpy'], GOAL_MEMCPY_FRAC)} goal) | "
                     f"{r['frac_of_memcpy_same_bytes']:.0%} ({r['memcpy_same_bytes_gbps']:.1f} GB/s) | "
                     f"{r['bucketed_learner_s']:.3f} | "
                     f"{r['bucketed_nocheck_s']:.3f}, {r['nocheck_frac_of_memcpy']:.0%} | "
                     f"{r['bucketed_torch_pack_s']:.3f}, {r['torch_pack_frac_of_memcpy']:.0%} | "
                     f"{r['bucketed_broadcast_only_s']:.3f} | "
                     f"{into['per_tensor']:.3f}, {into['bucketed']:.3f}, {r['into_models_frac_of_memcpy']:.0%} "
                     f"({r['nocheck_into_models_frac_of_memcpy']:.0%}) |")
    lines += ["", "Checksum (int64 word sums, one core): " + ", ".join(
        f"{k}: {r['checksum_gbps']:.1f} GB/s" for k, r in res["sizes"].items())
        + f". Packing kernel: {res.get('pack_kernel', '?')} (native: non-temporal stores, summing as it copies, "
        "large tensors in two halves on two threads; torch: Tensor.copy_ with the sums on a helper thread)."]
    return "\n".join(lines)
