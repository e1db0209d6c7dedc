"""Each component's command line, written once: the one-host launcher (runner/launch.py), the live system of the
fault tools (runner/faults/live.py), the Ray launcher (runner/ray_launch.py, runner/ray_ranks.py) and the Slurm
renderer (runner/slurm.py) all start the buffer, the learner and the actor fleet with ``component_argv``.
Standard library only: a Ray worker and ``bin/slurm`` import it without the rest of the project."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

REPO = Path(__file__).resolve().parent.parent
COMPONENTS = ("buffer", "learner", "actors")
OPTION_OF = {"--resume": "learner", "--ranks": "learner", "--num": "actors", "--first-id": "actors",
             "--connect": "actors"}


def component_argv(component: str, config: str, run_dir: str, *, overrides: Sequence[str] = (),
                   python: Optional[str] = sys.executable, repo: str = str(REPO), resume: bool = False,
                   ranks: Optional[int] = None, num: Optional[int] = None, first_id: Union[int, str] = 0,
                   connect: Optional[str] = None) -> list[str]:
    """``[python] REPO/bin/COMPONENT CONFIG [overrides] --run-dir RUN_DIR`` plus the learner's ``--resume`` / ``--ranks
    N`` and the fleet's ``--num N`` / ``--first-id K`` / ``--connect ENDPOINTS``. ``python=None``: the script's shebang.
    Values are used as given, so a renderer may pass shell expressions (``shell_join`` quotes them)."""
    if component not in COMPONENTS:
        raise ValueError(f"component {component!r} is not one of {', '.join(COMPONENTS)}")
    given = {"--resume": resume, "--ranks": ranks is not None, "--num": num is not None, "--first-id": first_id != 0,
             "--connect": connect is not None}
    wrong = [flag for flag, on in given.items() if on and OPTION_OF[flag] != component]
    if wrong:
        raise ValueError(f"{component}: {', '.join(wrong)} is an option of another component")
    argv = ([python] if python else []) + [f"{repo}/bin/{component}", config, *overrides, "--run-dir", run_dir]
    if resume:
        argv.append("--resume")
    if ranks is not None:
        argv += ["--ranks", str(ranks)]
    if num is not None:
        argv += ["--num", str(num)]
    if first_id != 0:
        argv += ["--first-id", str(first_id)]
    if connect is not None:
        argv += ["--connect", connect]
    return argv


def shell_join(argv: Sequence[str]) -> str:
    """``argv`` as a bash command line: a word holding ``$`` (a variable or arithmetic expansion the script means)
    goes in double quotes, every other word through ``shlex.quote``."""
    def word(w: str) -> str:
        if "$" not in w:
            return shlex.quote(w)
        if any(c in w for c in '"`\\'):
            raise ValueError(f"{w!r}: a word with a shell expansion cannot also hold a quote or a backslash")
        return f'"{w}"'
    return " ".join(word(w) for w in argv)
