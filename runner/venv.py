"""Let `bin/*` scripts run without activating the project's virtual environment first.

`bin/quickstart` and `bin/test` install everything into `<repo>/.venv`; a researcher who then types
`bin/train ...` from a plain shell would otherwise meet a ModuleNotFoundError for the first dependency."""

import os
import sys
from pathlib import Path


def use_repo_venv(repo: Path) -> None:
    """Re-exec the running script under `<repo>/.venv/bin/python` when that exists and is not already running.

    A no-op inside any other virtual environment (a user's own install) and when the venv is missing."""
    venv_python = repo / ".venv" / "bin" / "python"
    in_some_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    if in_some_venv or not venv_python.exists() or os.environ.get("ASYNC_VLA_NO_VENV_REEXEC"):
        return
    os.execv(str(venv_python), [str(venv_python), *sys.argv])
