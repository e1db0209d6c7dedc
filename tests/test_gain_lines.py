"""The lines bin/quickstart ends with: start, final, RL's gain and its p-value, from a run's summary.json."""

from runner.report import final_eval, gain_lines


def summary(start_successes, final_successes, eval_at_start=True, stopped_on="budget"):
    evals = [{"version": 0, "wall_s": 3.0, "success_rate": start_successes / 200, "successes": start_successes,
              "episodes": 200, "split": "eval"}] if eval_at_start else []
    evals.append({"version": 10, "wall_s": 30.0, "success_rate": 0.5, "successes": 100, "episodes": 200,
                  "split": "eval"})
    last = {"version": 850, "wall_s": 600.0, "success_rate": final_successes / 200, "successes": final_successes,
            "episodes": 200, "split": "eval"}
    return {"seed": 2, "eval_split": "eval", "eval": evals + [last], "final_eval": final_eval(last), "wall_s": 612.0,
            "budget": {"max_wall_s": 600.0}, "stopped_on": stopped_on,
            "confirm_evals": [{"version": 850, "success_rate": 0.93, "episodes": 200}] if stopped_on == "target"
            else []}


def test_the_gain_lines_give_start_final_the_gain_and_its_one_sided_p():
    lines = gain_lines(summary(66, 170))
    assert lines[0] == "held-out (eval) greedy success, 95% intervals, seed 2:"
    assert lines[1].startswith("  start  0.330 (66/200, 0.269-0.398)")
    assert lines[2] == ("  final  0.850 (170/200, 0.794-0.893)  version 850, 612 s of run wall time "
                        "(RL budget 600 s), stopped on budget")
    # 66/200 -> 170/200: the one-sided Fisher exact p is 2.1e-27 (docs/BENCHMARKS.md's kponly seed 0)
    assert lines[3] == "  RL's gain +0.520 (one-sided Fisher exact p = 2.1e-27)"


def test_a_run_that_got_worse_shows_a_negative_gain_and_a_large_p():
    lines = gain_lines(summary(120, 100, stopped_on="target"))
    assert "stopped on target, confirmed on 200 other held-out episodes: 0.930" in lines[2]
    gain, p = lines[3].split(" (one-sided Fisher exact p = ")
    assert gain == "  RL's gain -0.100" and float(p.rstrip(")")) > 0.9


def test_without_a_start_evaluation_the_lines_say_so_and_give_no_gain():
    lines = gain_lines(summary(66, 170, eval_at_start=False))
    assert lines[1] == "  start  not evaluated (run.eval_at_start=false): no gain to report"
    assert len(lines) == 3 and not any("gain +" in s for s in lines)


def test_a_summary_without_episode_counts_gives_the_rates_and_no_p_value():
    old = summary(66, 170)
    old["final_eval"] = {"version": 850, "split": "eval", "wall_s": 600.0, "success": 0.85}
    lines = gain_lines(old)
    assert lines[1] == "  start  0.330" and lines[2].startswith("  final  0.850  version 850")
    assert lines[3] == "  no episode counts: no p-value"
