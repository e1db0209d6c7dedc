"""An actor's weight sources, in order: the broadcast, then a catch-up from the learner's exports that starts only
once the buffer has refused the actor's weights ("behind" / "dead") for CATCH_UP_GRACE_S, at most once per grace
period, mirroring from the learner's node first when there is no shared run directory."""

from __future__ import annotations

import types

from async_vla.messages import PolicyTag
from async_vla.weights.sources import CATCH_UP_GRACE_S, Broadcast, CatchUp, WeightSources


def test_the_broadcast_first_then_a_catch_up_only_while_the_buffer_refuses_our_weights():
    clock = [100.0]
    broadcasts: list = []
    asked: list = []
    mirrored: list = []

    def fetch_latest(newer_than=None):
        asked.append(newer_than)
        return (PolicyTag("l", 9), {"w": 9}) if newer_than is None or newer_than.version < 9 else None

    sub = types.SimpleNamespace(poll=lambda: broadcasts.pop() if broadcasts else None, fetch_latest=fetch_latest)
    catch_up = CatchUp(sub, mirror=mirrored.append, clock=lambda: clock[0])
    chain = WeightSources(Broadcast(sub), catch_up)
    assert catch_up.latest() == (PolicyTag("l", 9), {"w": 9}) and mirrored == [None]     # an actor's start
    held = PolicyTag("l", 5)
    assert chain.poll(held, "wait") is None and chain.poll(held, "") is None and asked == [None]   # not refused
    assert chain.poll(held, "behind") is None                      # refused: the broadcast may be on its way
    broadcasts.append((PolicyTag("l", 6), {"w": 6}))
    assert chain.poll(held, "behind") == (PolicyTag("l", 6), {"w": 6})   # and it came
    clock[0] += CATCH_UP_GRACE_S
    assert chain.poll(held, "behind") == (PolicyTag("l", 9), {"w": 9}) and asked[-1] == held and mirrored[-1] == held
    assert chain.poll(PolicyTag("l", 9), "dead") is None            # at most once per grace period
    clock[0] += CATCH_UP_GRACE_S
    assert chain.poll(PolicyTag("l", 9), "dead") is None and asked[-1] == PolicyTag("l", 9)   # nothing newer
    assert chain.taken == {"broadcast": 1, "export": 1}
