"""bin/* scripts re-exec under the repo's .venv when started from an interpreter without the project's
dependencies (runner.venv), once at most, and never when the interpreter has them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.venv import CORE_MODULES

REPO = Path(__file__).resolve().parent.parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def _base_lacks_deps() -> bool:
    if not BASE_PYTHON.exists():
        return False
    probe = ("import importlib.util, sys; "
             f"sys.exit(0 if all(importlib.util.find_spec(m) for m in {CORE_MODULES!r}) else 1)")
    return subprocess.run([str(BASE_PYTHON), "-c", probe], env={}, timeout=60).returncode == 1


needs_bare_base = pytest.mark.skipif(not _base_lacks_deps(),
                                     reason="needs a base interpreter without the project's dependencies")


def _fake_repo(tmp_path: Path, venv_python: str = "script") -> Path:
    """A repo whose .venv/bin/python is a shell script reporting how it was called (or a link to the base
    interpreter: a `.venv` that is no working environment)."""
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "python"
    if venv_python == "script":
        fake.write_text('#!/bin/sh\necho "venv-python $*"\n')
        fake.chmod(0o755)
    else:
        fake.symlink_to(BASE_PYTHON)
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nfrom pathlib import Path\nsys.path.insert(0, {str(REPO)!r})\n"
                      f"from runner.venv import use_repo_venv\nuse_repo_venv(Path({str(tmp_path)!r}))\n"
                      "print('ran-in-place')\n")
    return script


def _run(python: Path, script: Path, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ASYNC_VLA_NO_VENV_REEXEC")}
    clean.update(env)
    out = subprocess.run([str(python), str(script), "a", "b=1"], capture_output=True, text=True, timeout=60,
                         env=clean)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_bare_base
def test_an_interpreter_without_the_dependencies_reexecs_under_repo_venv_with_the_same_arguments(tmp_path):
    script = _fake_repo(tmp_path)
    assert _run(BASE_PYTHON, script) == f"venv-python {script} a b=1"
    assert _run(BASE_PYTHON, script, ASYNC_VLA_NO_VENV_REEXEC="1") == "ran-in-place"


@needs_bare_base
def test_a_venv_that_is_no_working_environment_is_tried_once_not_forever(tmp_path):
    script = _fake_repo(tmp_path, venv_python="link-to-base")
    assert _run(BASE_PYTHON, script) == "ran-in-place"     # re-exec'd once; then the guard lets it run


def test_an_interpreter_with_the_dependencies_runs_in_place(tmp_path):
    # this one (the test suite's) has them, venv or not: a user's conda env or CUDA image is never hijacked
    assert _run(Path(sys.executable), _fake_repo(tmp_path)) == "ran-in-place"


@needs_bare_base
def test_missing_venv_runs_in_place(tmp_path):
    script = _fake_repo(tmp_path)
    (tmp_path / ".venv" / "bin" / "python").unlink()
    assert _run(BASE_PYTHON, script) == "ran-in-place"
