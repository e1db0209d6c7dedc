"""runner/commands.py: the one builder of each component's command line (the local launcher, the live system of
the fault tools, the Ray launcher and the Slurm renderer use it), and its shell rendering."""

from __future__ import annotations

import subprocess

import pytest

from runner.commands import REPO, component_argv, shell_join


def test_each_component_gets_its_script_config_overrides_run_dir_and_own_options():
    assert component_argv("buffer", "c.yaml", "run", python="py", overrides=["a.b=1"]) == \
        ["py", f"{REPO}/bin/buffer", "c.yaml", "a.b=1", "--run-dir", "run"]
    assert component_argv("learner", "c.yaml", "run", python=None, repo="/r", resume=True, ranks=2) == \
        ["/r/bin/learner", "c.yaml", "--run-dir", "run", "--resume", "--ranks", "2"]
    assert component_argv("actors", "c.yaml", "run", python="py", repo="/r", num=3, first_id=6, connect="tcp://h:1") \
        == ["py", "/r/bin/actors", "c.yaml", "--run-dir", "run", "--num", "3", "--first-id", "6", "--connect",
            "tcp://h:1"]


def test_the_learner_command_is_what_the_learner_parses():
    from learner.__main__ import parse_args

    args = parse_args(component_argv("learner", "c.yaml", "run", overrides=["x.y=2"], resume=True, ranks=4)[2:])
    assert (args.config, args.overrides, args.run_dir, args.resume, args.ranks) == ("c.yaml", ["x.y=2"], "run",
                                                                                     True, 4)


@pytest.mark.parametrize("component, option", [("buffer", {"resume": True}), ("learner", {"num": 2}),
                                               ("actors", {"ranks": 2}), ("buffer", {"connect": "tcp://h:1"})])
def test_an_option_of_another_component_is_refused(component, option):
    flag = "--" + next(iter(option)).replace("_", "-")
    with pytest.raises(ValueError, match=f"{component}: {flag} is an option of another component"):
        component_argv(component, "c.yaml", "run", **option)


def test_an_unknown_component_is_refused():
    with pytest.raises(ValueError, match="not one of buffer, learner, actors"):
        component_argv("evaluator", "c.yaml", "run")


def test_shell_join_keeps_the_scripts_expansions_and_quotes_everything_else():
    line = shell_join(["$REPO/bin/buffer", "a b", "${SERVER[@]}", "--first-id", "$((SLURM_PROCID * 6))", "x'y"])
    assert line == """"$REPO/bin/buffer" 'a b' "${SERVER[@]}" --first-id "$((SLURM_PROCID * 6))" 'x'"'"'y'"""
    out = subprocess.run(["bash", "-c", f"REPO=/r SLURM_PROCID=2 SERVER=(s1 's 2'); printf '%s\\n' {line}"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["/r/bin/buffer", "a b", "s1", "s 2", "--first-id", "12", "x'y"]
    with pytest.raises(ValueError, match="cannot also hold a quote"):
        shell_join(['$X"'])
