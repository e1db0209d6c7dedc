"""Weight broadcast: bucket layout, checksums, exports, and real gloo broadcasts to actor processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import time
import multiprocessing as mp

import pytest
import torch

from async_vla.config import Config
from tests.weight_helpers import FAST, weights_cfg
from async_vla.weight_buckets import Layout, checksum, pack, plan, spec_of, unpack
from async_vla.weight_pool import BufferPool
from async_vla.weight_export import export_weights, read_latest, write_safetensors
from async_vla.weights import WeightPublisher, WeightSubscriber

def _cfg(**weights) -> Config:
    return weights_cfg(FAST, **weights)


def _model(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes like a small transformer (plus odd cases: 0-d, empty, bool, int)."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(500 * scale, 64, generator=g)}
    for i in range(3):
        out[f"layers.{i}.attn.qkv"] = torch.randn(192, 64 * scale, generator=g)
        out[f"layers.{i}.attn.bias"] = torch.randn(192, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.mlp.up"] = torch.randn(256, 64 * scale, generator=g).to(torch.float16)
        out[f"layers.{i}.norm"] = torch.ones(64)
    out["head.big"] = torch.randn(300 * scale, 300, generator=g)       # > 0.25 MiB cap: its own bucket
    out["temperature"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 3)
    out["mask"] = torch.rand(37, generator=g) > 0.5
    out["steps"] = torch.arange(11, dtype=torch.int64)
    return out


# ----------------------------------------------------------------------------------- layout, checksum, export
def test_bucket_roundtrip_mixed_dtypes_and_caps():
    model = _model(0)
    model["transposed"] = torch.randn(40, 30).t()                       # non-contiguous input
    for cap in (1, 4096, 256 * 1024, 1 << 30):
        layout, buckets = pack(model.items(), cap)
        # The receiver derives the identical layout from the manifest alone.
        assert Layout.from_manifest_bytes(layout.manifest_bytes()) == layout
        assert plan([spec_of(n, t) for n, t in model.items()], cap) == layout
        out = unpack(layout, buckets)
        assert list(out) == list(model)
        for name, t in model.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape
            assert torch.equal(out[name], t), name
        assert checksum(out) == checksum(model)
        for b, spec in zip(buckets, layout.buckets):
            assert b.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                               "int64": torch.int64, "bool": torch.bool}[spec.dtype]
            members = [e for e in layout.entries if buckets[e.bucket] is b]
            if b.numel() * b.element_size() > cap:                       # only a lone oversize tensor exceeds it
                assert len(members) == 1
        assert all(e.offset * torch.empty(0, dtype=buckets[e.bucket].dtype).element_size() % 64 == 0
                   for e in layout.entries)
    big = plan([spec_of(n, t) for n, t in model.items()], 256 * 1024)
    own = [e for e in big.entries if e.spec.name == "head.big"][0]
    assert [e.spec.name for e in big.entries if e.bucket == own.bucket] == ["head.big"]
    per_tensor = plan([spec_of(n, t) for n, t in model.items()], 1)
    assert len(per_tensor.buckets) >= len(model) - 1                    # the empty tensor shares a bucket


def test_checksum_is_exact_order_independent_and_sensitive():
    a = _model(1)
    assert checksum(a) == checksum(dict(reversed(list(a.items()))))
    assert checksum(a) == checksum({k: v.clone() for k, v in a.items()})
    assert 0 <= checksum(a) < 2**52
    b = {k: v.clone() for k, v in a.items()}
    b["layers.1.attn.qkv"][3, 5] += 1e-3
    assert checksum(b) != checksum(a)
    b = {k: v.clone() for k, v in a.items()}
    b["mask"][0] = ~b["mask"][0]
    assert checksum(b) != checksum(a)
    # A view at an unaligned offset gives the same value as its copy.
    base = torch.randn(1001)
    assert checksum({"x": base[1:]}) == checksum({"x": base[1:].clone()})


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("cap", [256, 64 * 1024, 1 << 30])
def test_the_packers_checksum_equals_the_checksum_of_the_model_with_or_without_a_helper_thread(cap, zero_copy):
    from concurrent.futures import ThreadPoolExecutor

    from async_vla.weight_buckets import BucketPacker

    model = _model(3, scale=2)
    with ThreadPoolExecutor(1) as ex:
        for summer in (None, ex):
            packer = BucketPacker(cap, zero_copy=zero_copy, summer=summer)
            for name, t in reversed(list(model.items())):      # any order in, the same value out
                packer.add(name, t)
            layout, buckets = packer.finish()
            assert packer.checksum() == checksum(model) == checksum(unpack(layout, buckets))
        small = BucketPacker(cap, summer=ex)
        small._summer.BATCH = 1                                  # one hand-off per tensor: same value
        for name, t in model.items():
            small.add(name, t)
        assert small.checksum() == checksum(model)


def test_the_same_tensors_reuse_the_previous_layout_and_any_change_makes_a_new_one():
    from async_vla.weight_buckets import BucketPacker, verify_shares

    def packed(model, previous=None):
        packer = BucketPacker(64 * 1024, previous=previous)
        for name, t in model.items():
            packer.add(name, t)
        layout, buckets = packer.finish()
        assert checksum(unpack(layout, buckets)) == checksum(model)
        return layout

    first = packed(_model(1))
    shares = verify_shares(first, 2)
    again = packed(_model(2), previous=first)           # new values, same names / dtypes / shapes
    assert again is first and verify_shares(again, 2) == shares
    renamed = dict(_model(2))
    renamed["steps2"] = renamed.pop("steps")
    reshaped = {**_model(2), "temperature": torch.tensor([1.5])}
    for changed in (renamed, reshaped):
        fresh = packed(changed, previous=first)
        assert fresh is not first and fresh == plan([spec_of(n, t) for n, t in changed.items()], 64 * 1024)
    assert packed(_model(2), previous=plan(first.specs, 1024)) is not first     # another cap


def test_manifest_validation_rejects_malformed():
    good = plan([spec_of("a", torch.zeros(3))], 1024).manifest_bytes()
    doc = json.loads(good)
    bad = [b"not json", json.dumps({**doc, "schema": 9}).encode(), json.dumps({**doc, "cap": -1}).encode(),
           json.dumps({**doc, "tensors": [["a", "complex64", [3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [-3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [3]], ["a", "float32", [3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [1] * 9]]}).encode()]
    for raw in bad:
        with pytest.raises(ValueError):
            Layout.from_manifest_bytes(raw)


def test_export_pointer_pruning_and_standard_reader(tmp_path):
    from safetensors.torch import load_file

    model = _model(2)
    for v in (1, 2, 3):
        export_weights(tmp_path, v, model, checksum(model), keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v2.safetensors", "v3.safetensors"]
    assert (tmp_path / "latest").read_text().strip() == "v3.safetensors"
    version, tensors, csum = read_latest(tmp_path)
    assert version == 3 and csum == checksum(model) and checksum(tensors) == csum
    assert read_latest(tmp_path, newer_than=3) is None and read_latest(tmp_path, newer_than=2)[0] == 3
    std = load_file(str(tmp_path / "v3.safetensors"))                 # the stock reader agrees
    assert all(torch.equal(std[k], model[k]) for k in model)
    (tmp_path / "latest").write_text("../../etc/passwd")               # an untrusted pointer is not followed
    assert read_latest(tmp_path)[0] == 3
    layout, buckets = pack(model.items(), 4096)                        # views sharing storage export fine
    write_safetensors(tmp_path / "views.safetensors", unpack(layout, buckets))
    assert checksum(load_file(str(tmp_path / "views.safetensors"))) == checksum(model)


def test_buffer_pool_never_reuses_a_buffer_someone_still_views():
    pool = BufferPool()
    a = pool.get(1000, torch.float32, "cpu")
    b = pool.get(1000, torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()                               # a is held: not handed out twice
    view = b[10:20]
    a_ptr = a.data_ptr()
    del a, b
    c = pool.get(1000, torch.float32, "cpu")
    assert c.data_ptr() == a_ptr                                      # a is free again
    assert pool.get(1000, torch.float32, "cpu").data_ptr() not in (a_ptr, view.data_ptr() - 40)
    layout, buckets = pack(_model(0).items(), 4096, pool=pool)
    held = unpack(layout, buckets)
    before = checksum(held)
    ptrs = {b.data_ptr() for b in buckets}
    del buckets
    layout2, buckets2 = pack(_model(1).items(), 4096, pool=pool)      # same shapes: must not overwrite `held`
    assert checksum(held) == before
    assert not ptrs & {b.data_ptr() for b in buckets2}
    del held
    ptrs |= {b.data_ptr() for b in buckets2}
    del buckets2
    _, buckets3 = pack(_model(2).items(), 4096, pool=pool)
    assert {b.data_ptr() for b in buckets3} <= ptrs                   # released buffers are reused
    pool.trim(0)                                                       # drops only buffers nobody views
    assert len(pool._bufs) == len(buckets3) + 2                        # buckets3, `c` and `view` are held
    del buckets3, c, view
    pool.trim(0)
    assert pool._bufs == []


# ----------------------------------------------------------------------------------- in-process broadcasts
def test_publish_without_actors_exports_and_fetch_latest(tmp_path):
    cfg = _cfg(export_async=False)
    pub = WeightPublisher(cfg, tmp_path)
    try:
        model = _model(3)
        st = pub.publish(1, model.items())
        assert st["receivers"] == 0 and st["failures"] == 0 and st["checksum"] == checksum(model)
        sub = WeightSubscriber(cfg, 7, tmp_path)                          # port from <run>/weights/endpoint.json
        try:
            version, tensors = sub.fetch_latest()
            assert version == 1 and checksum(tensors) == st["checksum"] and sub.version == 1
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_subscriber_of_another_wire_version_stays_out_and_says_why(tmp_path, caplog):
    from async_vla.weight_wire import WIRE_VERSION

    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path)
    pub._store.set("w/wire", str(WIRE_VERSION + 1))      # a learner from a newer release
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        end = time.monotonic() + 20
        while sub.stats["wire_mismatch"] < 2 and time.monotonic() < end:    # asked, and asked again
            time.sleep(0.05)
        assert sub.stats["wire_mismatch"] >= 2 and sub.stats["connects"] == 0
        assert pub.live_actors() == [] and pub.publish(1, _model(1).items())["receivers"] == 0
        said = [r.getMessage() for r in caplog.records if "weight wire" in r.getMessage()]
        assert len(said) == 1 and f"v{WIRE_VERSION + 1}" in said[0] and f"v{WIRE_VERSION}" in said[0]
        pub._store.set("w/wire", str(WIRE_VERSION))          # the same release again: it joins
        assert pub.wait_for_actors(1, 20) == 1
    finally:
        sub.close()
        pub.close()


def test_threads_receive_and_follow_a_restarted_publisher(tmp_path):
    """Subscriber threads in this process; the publisher restarts on a new port (resume) and they follow."""
    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, i, tmp_path) for i in (1, 2)]
    try:
        assert pub.wait_for_actors(2, 20) == 2
        model = _model(4)
        st = pub.publish(5, model.items())
        assert st["receivers"] == 2 and st["confirmed"] == 2, st
        held = []
        for s in subs:
            version, tensors = s.poll(timeout=10)
            assert version == 5 and checksum(tensors) == checksum(model) and s.lineage == 0
            assert s.poll() is None                                      # handed out once
            held.append(tensors)
        for version in (6, 7):                                           # receive buffers are pooled ...
            assert pub.publish(version, _model(version).items())["confirmed"] == 2
            assert all(s.poll(timeout=10)[0] == version for s in subs)
        assert all(checksum(h) == checksum(model) for h in held)         # ... but never while still viewed
        pub.close()
        pub = WeightPublisher(cfg, tmp_path)                             # new port, same run dir
        assert pub.wait_for_actors(2, 30) == 2
        model = _model(5)
        st = pub.publish(8, model.items())
        assert st["confirmed"] == 2, st
        assert all(s.poll(timeout=10)[0] == 8 for s in subs)
        assert all(s.lineage == 1 for s in subs)                          # a new learner session, counted
        pub.close()
        pub = WeightPublisher(cfg, tmp_path)        # resumed from an older checkpoint: its versions restart lower
        assert pub.wait_for_actors(2, 30) == 2
        assert pub.publish(6, _model(6).items())["confirmed"] == 2
        got = [s.poll(timeout=10) for s in subs]
        assert all(g is not None and g[0] == 6 and checksum(g[1]) == checksum(_model(6)) for g in got)
        assert all(s.lineage == 2 for s in subs)     # what lets the vLLM backend's guard take the lower version
    finally:
        t0 = time.monotonic()
        for s in subs:
            s.close()
        closed_in = time.monotonic() - t0
        pub.close()
    assert all(not s._thread.is_alive() for s in subs) and closed_in < 2.0   # close() wakes the thread


def test_subscriber_waits_for_a_publisher_that_starts_later_and_closes_promptly(tmp_path):
    cfg = _cfg()
    sub = WeightSubscriber(cfg, 3, tmp_path)                             # nothing to connect to yet
    time.sleep(0.5)
    pub = WeightPublisher(cfg, tmp_path)
    try:
        assert pub.wait_for_actors(1, 30) == 1
        assert pub.publish(1, _model(6).items())["confirmed"] == 1
        assert sub.poll(timeout=10)[0] == 1
    finally:
        pub.close()
        t0 = time.monotonic()
        sub.close()
        assert time.monotonic() - t0 < 2.0 and not sub._thread.is_alive()


# ----------------------------------------------------------------------------------- actor processes
def _actor_main(run_dir: str, port: int, actor_id: int, overrides: dict, q, fetch: bool, die_in: int) -> None:
    torch.set_num_threads(1)
    cfg = _cfg(**overrides)
    if die_in:   # kill -9 ourselves in the middle of the die_in-th broadcast: header in, buckets in flight
        import async_vla.weight_wire as weights_mod   # recv_version (the receive path) parses through it

        real, calls = weights_mod.parse_header, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == die_in:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        weights_mod.parse_header = dying
    sub = WeightSubscriber(cfg, actor_id, run_dir, "127.0.0.1", port)
    if fetch:
        got = sub.fetch_latest()
        q.put(("fetched", actor_id, got[0] if got else -1, checksum(got[1]) if got else 0.0))
    q.put(("ready", actor_id, os.getpid()))
    parent = os.getppid()
    while os.getppid() == parent:                                         # exit if the test process died
        got = sub.poll(timeout=0.5)
        if got is not None:
            q.put(("got", actor_id, got[0], checksum(got[1])))


class _Actors:
    """Actor processes (spawn), each reporting into a queue of its own (a fresh one per start): writers of one
    ``mp.Queue`` share a lock, and an actor stopped (SIGSTOP) or killed while its feeder thread held it would
    silence the others. The test kills only these, by pid."""

    def __init__(self, run_dir, port, overrides=None):
        self.ctx = mp.get_context("spawn")
        self.queues: list = []
        self.run_dir, self.port, self.overrides = str(run_dir), port, overrides or {}
        self.procs: dict[int, mp.Process] = {}
        self.log: list[tuple] = []

    def start(self, actor_id: int, fetch: bool = False, die_in: int = 0) -> None:
        q = self.ctx.Queue()
        self.queues.append(q)
        p = self.ctx.Process(target=_actor_main, daemon=True,
                             args=(self.run_dir, self.port, actor_id, self.overrides, q, fetch, die_in))
        p.start()
        self.procs[actor_id] = p
        self.wait(lambda m: m[0] == "ready" and m[1] == actor_id, 60)

    def wait(self, pred, timeout: float):
        end = time.monotonic() + timeout
        for m in self.log:
            if pred(m):
                return m
        while time.monotonic() < end:
            got = False
            for q in self.queues:
                try:
                    m = q.get_nowait()
                except queue.Empty:
                    continue
                got = True
                self.log.append(m)
                if pred(m):
                    return m
            if not got:
                time.sleep(0.01)
        raise AssertionError(f"timed out; messages so far: {self.log}")

    def got(self, actor_id: int, version: int, timeout: float = 20):
        return self.wait(lambda m: m[0] == "got" and m[1] == actor_id and m[2] == version, timeout)

    def signal(self, actor_id: int, sig) -> None:
        os.kill(self.procs[actor_id].pid, sig)

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                with_sig = signal.SIGCONT
                os.kill(p.pid, with_sig)
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


@pytest.fixture
def world(tmp_path):
    made = []

    def make(n_actors: int, die: dict | None = None, **overrides):
        cfg = _cfg(**overrides)
        pub = WeightPublisher(cfg, tmp_path)
        actors = _Actors(tmp_path, pub.port, overrides)
        made.append((pub, actors))
        for i in range(1, n_actors + 1):
            actors.start(i, die_in=(die or {}).get(i, 0))
        assert pub.wait_for_actors(n_actors, 30) == n_actors
        return pub, actors

    yield make
    for pub, actors in made:
        actors.close()
        pub.close()


@pytest.mark.slow
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "wire"])
def test_two_actor_processes_receive_versions_with_matching_checksums(world, shm):
    pub, actors = world(2, shm=shm)
    for version in (1, 2):
        model = _model(10 + version)
        st = pub.publish(version, model.items())
        assert st["receivers"] == 2 and st["confirmed"] == 2 and st["failures"] == 0, st
        assert st["transport"] == ("shm" if shm else "gloo")
        assert st["bytes"] == sum(t.numel() * t.element_size() for t in model.values())
        for a in (1, 2):
            assert actors.got(a, version)[3] == st["checksum"] == checksum(model)
    assert st["epoch"] == 1 and not st["formed"]                        # same members: no re-forming


@pytest.mark.slow
def test_kill9_between_broadcasts_learner_continues_and_survivor_receives(world):
    pub, actors = world(2, join_timeout_s=3.0)   # as in the test below
    timeout = pub.timeout_s
    pub.publish(1, _model(20).items())
    actors.got(1, 1), actors.got(2, 1)
    actors.signal(1, signal.SIGKILL)
    actors.procs[1].join(5)
    t0 = time.monotonic()
    st = pub.publish(2, _model(21).items())                              # the dead member is still in the group
    assert time.monotonic() - t0 < timeout + 3.0, st   # 3 s: pack, re-form and resend on a loaded host
    assert st["failures"] >= 1 and st["epoch"] >= 2 and st["confirmed"] == 1, st   # retried without it
    assert actors.got(2, 2)[3] == st["checksum"]
    st = pub.publish(3, _model(22).items())
    assert st["receivers"] == 1 and st["confirmed"] == 1 and st["failures"] == 0, st
    actors.got(2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "wire"])
def test_kill9_during_broadcast_never_hangs_the_learner(world, shm):
    # actor 1 dies inside broadcast 2. join_timeout_s at the production default (3 s, not FAST's 1 s): the
    # survivor must notice the broken epoch and answer the re-forming invite in time; under a loaded CI machine
    # 1 s was once too short (it then misses only this publish, which this test asserts it does not).
    pub, actors = world(2, die={1: 2}, bucket_mb=4.0, join_timeout_s=3.0, shm=shm)
    model = {f"w{i}": torch.randn(1024, 1024) for i in range(12)}        # 48 MiB in 12 buckets
    st = pub.publish(1, model.items())
    assert st["confirmed"] == 2, st
    model["w0"] += 1
    t0 = time.monotonic()
    st = pub.publish(2, model.items())
    assert time.monotonic() - t0 < pub.timeout_s + 3.0, st
    assert st["failures"] >= 1 and st["receivers"] == 1 and st["confirmed"] == 1, st   # retried without it
    assert actors.got(2, 2)[3] == st["checksum"] == checksum(model)
    assert not actors.procs[1].is_alive()


@pytest.mark.slow
def test_late_actor_fetches_latest_then_joins_the_next_broadcast(world):
    pub, actors = world(1, export_async=False)
    m1 = _model(30)
    st = pub.publish(1, m1.items())
    actors.got(1, 1)
    actors.start(2, fetch=True)                                           # immediately: from the exported file
    fetched = actors.wait(lambda m: m[0] == "fetched" and m[1] == 2, 5)
    assert fetched[2] == 1 and fetched[3] == st["checksum"]
    assert pub.wait_for_actors(2, 30) == 2
    st = pub.publish(2, _model(31).items())                               # and via the next broadcast
    assert st["formed"] and st["receivers"] == 2 and st["confirmed"] == 2, st
    assert actors.got(2, 2)[3] == actors.got(1, 2)[3] == st["checksum"]


@pytest.mark.slow
def test_stopped_actor_is_bounded_by_the_timeout_and_rejoins(world):
    pub, actors = world(2, timeout_s=3.0)
    pub.publish(1, _model(40).items())
    actors.got(1, 1), actors.got(2, 1)
    actors.signal(1, signal.SIGSTOP)                                     # alive but unresponsive
    t0 = time.monotonic()
    st = pub.publish(2, _model(41).items())
    assert time.monotonic() - t0 < 3.0 + 3.0 and st["failures"] >= 1, st
    time.sleep(5 * FAST["heartbeat_s"] + 0.2)                             # its heartbeat is now stale
    st = pub.publish(3, _model(42).items())
    assert st["receivers"] == 1 and st["confirmed"] == 1, st
    actors.got(2, 3)
    actors.signal(1, signal.SIGCONT)                                     # it wakes up and is taken back
    assert pub.wait_for_actors(2, 30) == 2
    for version in range(4, 10):
        st = pub.publish(version, _model(43).items())
        if st["confirmed"] == 2:
            break
        time.sleep(0.5)
    assert st["confirmed"] == 2, st
    actors.got(1, st["version"])


@pytest.mark.gpu
def test_nccl_broadcast_to_an_actor_process(world):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pub, actors = world(1, backend="nccl")
    model = {k: v.cuda() for k, v in _model(50).items()}
    st = pub.publish(1, model.items())
    assert st["receivers"] == 1 and st["confirmed"] == 1, st
    assert actors.got(1, 1)[3] == checksum(model)

