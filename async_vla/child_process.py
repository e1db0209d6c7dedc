"""Helpers for the processes bin/ scripts start (this module starts none itself): on Linux a child gets SIGTERM when
its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a launcher killed outright leaves no orphans holding ports, cores
and GPU memory; elsewhere the children's own parent-pid checks are all there is."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGTERM this child when the process that started it dies (Linux;
    a no-op elsewhere). Runs in the child between fork and exec: nothing here may raise."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
