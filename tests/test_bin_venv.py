"""bin/* scripts re-exec under the repo's .venv when started from a plain interpreter (runner.venv)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def _fake_repo(tmp_path: Path) -> Path:
    """A repo whose .venv/bin/python is a shell script reporting how it was called."""
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "python"
    fake.write_text('#!/bin/sh\necho "venv-python $*"\n')
    fake.chmod(0o755)
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


@pytest.mark.skipif(not BASE_PYTHON.exists() or sys.prefix == sys.base_prefix,
                    reason="needs the tests to run inside a venv with a base interpreter beside it")
def test_plain_interpreter_reexecs_under_repo_venv_with_the_same_arguments(tmp_path):
    script = _fake_repo(tmp_path)
    assert _run(BASE_PYTHON, script) == f"venv-python {script} a b=1"


def test_inside_a_venv_or_opted_out_runs_in_place(tmp_path):
    script = _fake_repo(tmp_path)
    if sys.prefix != sys.base_prefix:  # this interpreter is some venv: never hijacked
        assert _run(Path(sys.executable), script) == "ran-in-place"
    if BASE_PYTHON.exists():
        assert _run(BASE_PYTHON, script, ASYNC_VLA_NO_VENV_REEXEC="1") == "ran-in-place"


def test_missing_venv_runs_in_place(tmp_path):
    script = _fake_repo(tmp_path)
    (tmp_path / ".venv" / "bin" / "python").unlink()
    assert _run(Path(sys.executable), script) == "ran-in-place"
