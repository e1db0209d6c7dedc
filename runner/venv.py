"""Let `bin/*` scripts run without activating `<repo>/.venv` first (what `bin/quickstart` and `bin/test` install
into)."""

import importlib.util
import os
import sys
from pathlib import Path

# What every bin/ script needs: an interpreter that has these runs as it is (a user's own venv, conda env or
# CUDA image), whatever else is around.
CORE_MODULES = ("torch", "zmq", "msgpack", "omegaconf", "pydantic")
GUARD = "ASYNC_VLA_NO_VENV_REEXEC"


def use_repo_venv(repo: Path) -> None:
    """Re-exec the running script under `<repo>/.venv/bin/python` when this interpreter lacks the project's core
    dependencies and that venv exists. At most once (the guard variable is set for the new process, so a
    `.venv` that is not a working environment fails with the import error instead of looping)."""
    if os.environ.get(GUARD):
        return
    if all(importlib.util.find_spec(m) is not None for m in CORE_MODULES):
        return
    venv_python = repo / ".venv" / "bin" / "python"
    if not venv_python.exists():
        return
    os.environ[GUARD] = "1"
    os.execv(str(venv_python), [str(venv_python), *sys.argv])
