"""The receiver's side of one epoch's group: waiting on an op in slices, and asking whether the publisher gave the
epoch up (no process group needed: the op and the store are stand-ins with the same methods)."""

from __future__ import annotations

import time

import pytest
from timing import slack


class _Work:
    """A stand-in for a gloo op: ``done_after`` waits with a timeout before it completes (0 = never)."""

    def __init__(self, done_after: int, error: str = ""):
        self.calls, self.done_after, self.error = 0, done_after, error

    def wait(self, timeout=None):
        self.calls += 1
        if timeout is not None and (self.done_after == 0 or self.calls < self.done_after):
            raise RuntimeError("Operation timed out!")
        if timeout is not None and self.calls == self.done_after:   # completes just as the slice runs out
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done_after != 0 and self.calls >= self.done_after


def test_a_receive_waits_in_slices_and_reports_what_the_op_itself_did():
    from async_vla.weights.wire import BroadcastGroup

    g = BroadcastGroup.__new__(BroadcastGroup)       # only _finish's state: no process group needed
    g.backend, g.epoch, g.dropped = "gloo", 3, lambda: False
    g._finish(_Work(done_after=3), 30.0)             # finished as a slice timed out: that is a success
    with pytest.raises(RuntimeError, match="peer closed"):
        g._finish(_Work(done_after=2, error="peer closed"), 30.0)   # its own error, not "timed out"
    g.dropped = lambda: True
    with pytest.raises(RuntimeError, match="dropped epoch 3"):
        g._finish(_Work(done_after=0), 30.0)          # the publisher gave up on the epoch: leave now
    g.dropped = lambda: False
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        g._finish(_Work(done_after=0), 0.05)          # our own time ran out
    assert time.monotonic() - t0 < slack(5)


def test_the_drop_check_answers_no_when_the_store_is_slow_and_raises_when_it_is_gone():
    import torch.distributed as dist

    from async_vla.weights.transport import POP_TIMEOUT_S, epoch_dropped

    class Store:
        def __init__(self, outcome):
            self.outcome, self.timeouts = outcome, []

        def set_timeout(self, t):
            self.timeouts.append(t.total_seconds())

        def check(self, keys):
            assert keys == ["w/e4/drop"]
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    for outcome, expected in ((True, True), (False, False), (dist.DistStoreError("timeout"), False)):
        store = Store(outcome)
        assert epoch_dropped(store, 4) is expected
        assert store.timeouts[0] < 5 and store.timeouts[-1] == POP_TIMEOUT_S   # short, then restored
    with pytest.raises(dist.DistNetworkError):
        epoch_dropped(Store(dist.DistNetworkError("reset")), 4)
