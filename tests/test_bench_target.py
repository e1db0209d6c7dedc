"""bin/bench target and async: time to a success level, sync / async ratios, the ideal overlap from phases."""

from benchmarks.target import level_times, ratios


def _summary(evals, target=0.9, time_to_target=None):
    return {"budget": {"target_success": target, "max_wall_s": 600},
            "eval": [{"version": 10 * i, "wall_s": t, "success_rate": s, "split": "eval"} for i, (t, s) in
                     enumerate(evals)],
            "time_to_target_s": time_to_target}


def test_level_times_take_the_first_evaluation_at_a_level_and_the_confirmed_stop_for_the_target():
    s = _summary([(5, 0.70), (30, 0.82), (45, 0.79), (50, 0.91)], time_to_target=55)
    assert level_times(s) == {0.80: 30, 0.90: 55}                 # 0.90: the confirmed crossing, not the eval's 50
    never = _summary([(5, 0.70), (600, 0.78)])
    assert level_times(never) == {0.80: None, 0.90: None}
    no_target = _summary([(5, 0.70), (40, 0.93)], target=None)
    assert level_times(no_target) == {0.80: 40, 0.90: 40}
    strong = _summary([(5, 0.85), (30, 0.92)], time_to_target=35)
    assert level_times(strong) == {0.80: 0.0, 0.90: 35}                # at 0.80 from the start: 0, not the v0 eval's 5


def test_ratios_are_sync_over_async_per_seed_with_a_missed_level_as_a_bound_at_the_budget():
    times = {0: {"async": {0.80: 30, 0.90: 60}, "sync": {0.80: 60, 0.90: 150}},
             1: {"async": {0.80: 20, 0.90: 100}, "sync": {0.80: 50, 0.90: None}},
             2: {"async": {0.80: 10, 0.90: None}, "sync": {0.80: 30, 0.90: None}},
             3: {"async": {0.80: 0.0, 0.90: 40}, "sync": {0.80: 0.0, 0.90: 40}}}       # started above 0.80
    r = ratios(times, budget_s=600)
    assert [p["ratio"] for p in r[0.80]["per_seed"]] == [2.0, 2.5, 3.0] and r[0.80]["median"] == 2.5
    assert r[0.80]["range"] == [2.0, 3.0] and not any(p["bound"] for p in r[0.80]["per_seed"])
    per = {p["seed"]: p for p in r[0.90]["per_seed"]}
    assert set(per) == {0, 1, 3} and per[0]["ratio"] == 2.5 and not per[0]["bound"]   # seed 2: neither got there
    assert per[1]["ratio"] == 6.0 and per[1]["bound"]                              # sync missed: the budget, a bound


def test_the_async_ideal_comes_from_the_sync_runs_busy_phases():
    from benchmarks.async_sync import busy_seconds, ideal_overlap

    phases = {"actor": {"seconds": {"wait_grant": 400.0, "startup": 2.0, "policy_forward": 180.0, "env_step": 20.0}},
              "learner": {"seconds": {"wait_batch": 200.0, "startup": 4.0, "forward_backward": 390.0,
                                      "optimizer": 10.0}}}
    busy = {kind: busy_seconds(phases, kind) for kind in ("actor", "learner")}
    assert busy == {"actor": 200.0, "learner": 400.0}          # waiting and start-up are not work
    assert ideal_overlap(busy) == 1.5                           # the learner sets the pace: (200 + 400) / 400
    assert ideal_overlap({"actor": 300.0, "learner": 300.0}) == 2.0
