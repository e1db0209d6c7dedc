"""The learner's credential: a per-run secret that only the learner ranks and the buffer read.

Whoever first needs it (the buffer, a learner rank, or a launcher before it starts ranks on other nodes) creates
``<run>/secrets/learner`` (``transport.learner_secret_file`` where a rank's run directory is not the buffer's):
32 random bytes, hex, mode 0600 in a 0700 folder, written whole before any reader can see it. Learner ranks sign
every ``BatchRequest`` with it (HMAC-SHA256 over the request's fields, ``BatchRequest.auth``); the buffer serves
only requests whose signature checks, so a peer that cannot read the run directory's secret (an actor on another
node, another user) cannot move the learner version, start a new lineage or take a batch. A live eta change on the
control socket (``ControlCommand("set_max_staleness")``) is signed the same way (an operator without the secret
writes ``<run>/control/max_staleness`` instead). Actors never get it: the
Slurm actor bundle and the Ray fleet's files hold keys and config only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from typing import Union

from async_vla.messages import BatchRequest, ControlCommand

Signed = Union[BatchRequest, ControlCommand]

SECRET_FILE = "secrets/learner"
SECRET_BYTES = 32


def secret_path(transport_cfg, run_dir) -> Path:
    """Where this process's learner secret is: ``transport.learner_secret_file``, else ``<run_dir>/secrets/learner``."""
    given = transport_cfg.learner_secret_file
    return Path(given) if given else Path(run_dir) / SECRET_FILE


def learner_secret(path) -> bytes:
    """The secret at ``path``, created first if there is none (race-free: written to a private file, then linked
    into place; a concurrent creator's file wins and both read it). ValueError if the file is readable by others
    or is not a secret this module wrote (the fix is named)."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(SECRET_BYTES).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path}: the learner secret is readable by others (mode {stat.S_IMODE(mode):o}); "
                         f"`chmod 600 {path}`")
    text = path.read_bytes().strip()
    if len(text) != 2 * SECRET_BYTES:
        raise ValueError(f"{path}: not a learner secret ({len(text)} characters, expected {2 * SECRET_BYTES} hex); "
                         "delete it and restart the run's buffer and learner together")
    return text


def _payload(msg: Signed) -> bytes:
    if isinstance(msg, ControlCommand):
        return f"control {msg.command} {msg.value!r}".encode()
    return f"batch_request {msg.rank} {msg.world} {msg.version} {float(msg.timeout_s)!r} {msg.lineage}".encode()


def sign(secret: bytes, req: Signed) -> Signed:
    """``req`` with its ``auth`` set: what a learner rank sends."""
    return dataclasses.replace(req, auth=hmac.new(secret, _payload(req), hashlib.sha256).hexdigest())


def verify(secret: bytes, req: Signed) -> str:
    """Why ``req`` is not the learner's: "no_credential", "bad_credential", or "" (it is)."""
    if not req.auth:
        return "no_credential"
    good = hmac.new(secret, _payload(req), hashlib.sha256).hexdigest()
    return "" if hmac.compare_digest(good, req.auth) else "bad_credential"
