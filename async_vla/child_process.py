"""Helpers for the processes bin/ scripts start (this module starts none itself).

Why: a launcher killed outright (kill -9, the OOM killer, a job scheduler's hard stop) cannot stop its children,
and a child in a session of its own does not get the terminal's hang-up either: buffer, learner ranks and actors
would run on as orphans, holding ports, cores and GPU memory. Linux can deliver a signal to a child when its parent
dies (``prctl(PR_SET_PDEATHSIG)``); with SIGTERM each child stops as it does on Ctrl-C (the learner saves its
final checkpoint). Elsewhere the children's own parent-pid checks are all there is.
"""

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
