"""Verification over the wire, with receivers in processes of their own: every receiver checks each version's
checksum against the one the learner computed while packing (``confirmed`` counts the matches; matching versions:
tests/test_weights.py); a version that does not match is refused by every receiver (counted) and the next one
arrives (async_vla.weights.wire)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch

from async_vla.config import Config
from tests.weight_helpers import weights_cfg
from async_vla.weights.packer import BucketPacker
from async_vla.weights.buckets import checksum
from async_vla.weights import WeightPublisher

FAST = {"timeout_s": 5.0, "join_timeout_s": 3.0, "heartbeat_s": 0.2, "bucket_mb": 0.25}
pytestmark = pytest.mark.slow


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(64 * (i + 1), 33, generator=g) for i in range(6)}
    out.update({"embed": torch.randn(500, 40, generator=g), "bias": torch.randn(7, generator=g),
                "half": torch.randn(301, generator=g).half(), "steps": torch.arange(3)})
    return out


def _cfg(**weights) -> Config:
    return weights_cfg(FAST, **weights)


def _actor(run_dir: str, port: int, actor_id: int, q) -> None:
    torch.set_num_threads(1)
    from async_vla.weights import WeightSubscriber

    sub = WeightSubscriber(_cfg(), actor_id, run_dir, "127.0.0.1", port)
    q.put(("ready", actor_id, 0))
    parent, errors = os.getppid(), 0
    while os.getppid() == parent:
        got = sub.poll(timeout=0.2)
        if got is not None:
            q.put(("got", actor_id, got[0].version, checksum(got[1])))
        if sub.stats["checksum_errors"] != errors:
            errors = sub.stats["checksum_errors"]
            q.put(("errors", actor_id, errors))


class _World:
    def __init__(self, run_dir):
        self.pub = WeightPublisher(_cfg(), run_dir)
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.log: list[tuple] = []
        self.procs = [ctx.Process(target=_actor, args=(str(run_dir), self.pub.port, a, self.q), daemon=True)
                      for a in (1, 2)]
        for p in self.procs:
            p.start()
        for a in (1, 2):
            self.wait(("ready", a))
        assert self.pub.wait_for_actors(2, 30) == 2

    def wait(self, prefix: tuple, timeout: float = 30.0) -> tuple:
        end = time.monotonic() + timeout
        while True:
            for m in self.log:
                if m[:len(prefix)] == prefix:
                    return m
            try:
                self.log.append(self.q.get(timeout=max(0.01, end - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no {prefix} in {self.log}") from None

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.join(5)
        self.pub.close()


@pytest.fixture
def world(tmp_path):
    w = _World(tmp_path)
    yield w
    w.close()


def test_a_version_whose_checksum_does_not_match_is_refused_and_the_next_one_arrives(world, monkeypatch):
    real = BucketPacker.checksum
    monkeypatch.setattr(BucketPacker, "checksum", lambda self: (real(self) + 1) % 2**52)   # the learner's record
    st = world.pub.publish(1, _model(20).items())                                          # disagrees
    assert st["confirmed"] == 0 and st["receivers"] == 2, st
    for a in (1, 2):
        assert world.wait(("errors", a, 1))
    monkeypatch.setattr(BucketPacker, "checksum", real)
    model = _model(21)
    st = world.pub.publish(2, model.items())
    assert st["confirmed"] == 2 and st["failures"] == 0, st
    for a in (1, 2):
        assert world.wait(("got", a, 2))[3] == checksum(model)
    assert not [m for m in world.log if m[0] == "got" and m[2] == 1]
