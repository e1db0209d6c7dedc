"""async_vla.phases: a PhaseClock charges every second to one phase (driven by a fake clock), the tables and
TensorBoard tags built from several processes' seconds, and the phases crossing the wire in ActorStats and
BatchRequest (malformed ones refused). The phase tables of real runs are checked in tests/test_train_e2e.py."""

import pytest

from async_vla.messages import ActorStats, BatchRequest, MalformedMessage, decode, encode
from async_vla.phases import PhaseClock, phase_scalars, phase_table, since


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_every_second_goes_to_one_phase_and_they_add_up_to_the_wall_time():
    t = FakeTime()
    clock = PhaseClock(clock=t)
    t.advance(1.0)                        # before any phase: "other"
    with clock.phase("env_step"):
        t.advance(2.0)
    with clock.phase("policy_forward"):
        t.advance(0.5)
    with clock.phase("env_step"):
        t.advance(3.0)
    t.advance(0.25)
    assert clock.seconds() == {"other": 1.25, "env_step": 5.0, "policy_forward": 0.5}
    assert sum(clock.seconds().values()) == pytest.approx(t.now - 100.0)


def test_a_nested_phase_pauses_the_outer_one():
    t = FakeTime()
    clock = PhaseClock(clock=t)
    with clock.phase("wait_grant"):
        t.advance(1.0)
        with clock.phase("weights"):
            t.advance(4.0)
            with clock.phase("weights"):     # the same name nested: still charged once
                t.advance(1.0)
        t.advance(2.0)
    assert clock.seconds() == {"wait_grant": 3.0, "weights": 5.0}


def test_the_running_phase_counts_up_to_now_and_rest_names_time_in_no_phase():
    t = FakeTime()
    clock = PhaseClock(rest="idle", clock=t)
    t.advance(2.0)
    with clock.phase("admit"):
        t.advance(1.0)
        assert clock.seconds() == {"idle": 2.0, "admit": 1.0}   # asked from inside the phase
        t.advance(1.0)
    assert clock.seconds() == {"idle": 2.0, "admit": 2.0}


def test_a_phase_left_by_an_exception_is_charged_and_closed():
    t = FakeTime()
    clock = PhaseClock(clock=t)
    with pytest.raises(RuntimeError):
        with clock.phase("env_step"):
            t.advance(1.5)
            raise RuntimeError("simulator died")
    t.advance(0.5)                          # back outside every phase
    assert clock.seconds() == {"env_step": 1.5, "other": 0.5}


def test_since_is_the_time_between_two_readings():
    t = FakeTime()
    clock = PhaseClock(clock=t)
    with clock.phase("wait_batch"):
        t.advance(1.0)
    before = clock.seconds()
    with clock.phase("wait_batch"):
        t.advance(2.0)
    with clock.phase("forward_backward"):
        t.advance(3.0)
    assert since(clock.seconds(), before) == {"wait_batch": 2.0, "forward_backward": 3.0}


def test_a_table_sums_the_processes_of_a_kind_and_the_scalars_name_each_share():
    actors = [{"env_step": 3.0, "wait_grant": 1.0}, {"env_step": 1.0, "other": 1.0, "send": 2.0}]
    table = phase_table(actors)
    assert table["processes"] == 2 and table["wall_s"] == 8.0
    assert table["seconds"] == {"env_step": 4.0, "send": 2.0, "wait_grant": 1.0, "other": 1.0}
    assert list(table["seconds"]) == ["env_step", "send", "wait_grant", "other"]   # largest first, other last
    assert table["frac"] == {"env_step": 0.5, "send": 0.25, "wait_grant": 0.125, "other": 0.125}
    tags = phase_scalars({"actor": table, "buffer": phase_table([{"idle": 3.0, "admit": 1.0}])})
    assert tags == {"time/actor/env_step_frac": 0.5, "time/actor/send_frac": 0.25,
                    "time/actor/wait_grant_frac": 0.125, "time/actor/other_frac": 0.125,
                    "time/buffer/idle_frac": 0.75, "time/buffer/admit_frac": 0.25}


def test_phases_cross_the_wire_and_malformed_ones_are_refused():
    phases = {"env_step": 2.5, "wait_grant": 1.0, "other": 0.0}
    stats = decode(encode(ActorStats(actor_id=3, phases=phases)))
    assert stats.phases == phases
    req = decode(encode(BatchRequest(rank=0, world=1, version=4, phases={"wait_batch": 7.0})))
    assert req.phases == {"wait_batch": 7.0}
    for bad in ({"env_step": -1.0}, {"env_step": float("nan")}, {"": 1.0}, {"x" * 33: 1.0}, {"env_step": True},
                {"env_step": "1"}, {f"p{i}": 1.0 for i in range(33)}):
        with pytest.raises(MalformedMessage):
            decode(encode(ActorStats(actor_id=3, phases=bad)))
        with pytest.raises(MalformedMessage):
            decode(encode(BatchRequest(rank=0, world=1, version=4, phases=bad)))
