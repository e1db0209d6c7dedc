"""The run's credentials: the learner's (``<run>/secrets/learner``, read by the learner ranks and the buffer only) and
the actors' (``<run>/secrets/actors``, read by the actors and the buffer): 32 random bytes each, 0600 in a 0700
folder, created by whoever needs one first. Learner ranks sign every ``BatchRequest`` and live eta change with an
HMAC-SHA256 over its fields, ``session`` and ``seq`` (replays are refused by the buffer's ``ReplayGuard``); an actor's
token is HMAC-SHA256(actor secret, "actor <id>"). Threats and what each stops: docs/RELIABILITY.md "Threats".
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Optional, Union

from async_vla.messages import ActorStats, BatchRequest, ControlCommand, GrantRequest, Heartbeat

Signed = Union[BatchRequest, ControlCommand]
ActorMessage = Union[GrantRequest, Heartbeat, ActorStats]

SECRET_FILE = "secrets/learner"
ACTOR_SECRET_FILE = "secrets/actors"
SECRET_BYTES = 32
MAX_CLOCK_SKEW_S = 60.0   # a signed message's seq may be this much older than the buffer's start (other nodes' clocks)
MAX_SESSIONS = 1024       # signing sessions remembered (learner ranks x starts); older ones leave a floor behind
REPLAY_WINDOW_S = 60.0    # how far behind its session's newest message a message may arrive (it is remembered)


def secret_path(transport_cfg, run_dir) -> Path:
    """Where this process's learner secret is: ``transport.learner_secret_file``, else ``<run_dir>/secrets/learner``."""
    given = transport_cfg.learner_secret_file
    return Path(given) if given else Path(run_dir) / SECRET_FILE


def actor_secret_path(transport_cfg, run_dir) -> Path:
    """Where this process's actor secret is: ``transport.actor_secret_file``, else ``<run_dir>/secrets/actors``."""
    given = transport_cfg.actor_secret_file
    return Path(given) if given else Path(run_dir) / ACTOR_SECRET_FILE


def learner_secret(path) -> bytes:
    """The learner secret at ``path`` (``secret_file``)."""
    return secret_file(path, "learner secret")


def actor_secret(path) -> bytes:
    """The actor secret at ``path`` (``secret_file``)."""
    return secret_file(path, "actor secret")


def secret_file(path, what: str) -> bytes:
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
        raise ValueError(f"{path}: the {what} is readable by others (mode {stat.S_IMODE(mode):o}); "
                         f"`chmod 600 {path}`")
    text = path.read_bytes().strip()
    if len(text) != 2 * SECRET_BYTES:
        raise ValueError(f"{path}: not a {what} ({len(text)} characters, expected {2 * SECRET_BYTES} hex); "
                         "delete it and restart the run's buffer, learner and actors together")
    return text


def _payload(msg: Signed) -> bytes:
    stamp = f"{msg.session} {msg.seq}"
    if isinstance(msg, ControlCommand):
        return f"control {msg.command} {msg.value!r} {stamp}".encode()
    return (f"batch_request {msg.rank} {msg.world} {msg.version} {float(msg.timeout_s)!r} {msg.lineage} "
            f"{json.dumps(msg.phases, sort_keys=True)} {stamp}").encode()


class _Session:
    """This process's signing session: a random id and a strictly increasing ``seq`` (wall-clock ns)."""

    def __init__(self) -> None:
        self.id, self.last, self.lock = secrets.token_hex(8), 0, threading.Lock()

    def next_seq(self) -> int:
        with self.lock:
            self.last = max(self.last + 1, time.time_ns())
            return self.last


_SESSION = _Session()


def sign(secret: bytes, req: Signed) -> Signed:
    """``req`` stamped with this process's session and the next ``seq`` and signed (``auth``): what a learner rank
    sends. Sign each send anew: a message sent twice is a replay."""
    req = dataclasses.replace(req, session=_SESSION.id, seq=_SESSION.next_seq())
    return dataclasses.replace(req, auth=hmac.new(secret, _payload(req), hashlib.sha256).hexdigest())


def verify(secret: bytes, req: Signed) -> str:
    """Why ``req`` is not the learner's: "no_credential", "bad_credential", or "" (its MAC checks; whether it is
    a replay is ``ReplayGuard``'s to say)."""
    if not req.auth:
        return "no_credential"
    good = hmac.new(secret, _payload(req), hashlib.sha256).hexdigest()
    return "" if hmac.compare_digest(good, req.auth) else "bad_credential"


class ReplayGuard:
    """The buffer's memory of signed messages: per session its newest ``seq`` and the seqs taken within
    REPLAY_WINDOW_S of it (at most MAX_SESSIONS sessions; a forgotten session's newest seq raises ``floor``, at or
    below which no message is taken). Only for messages whose MAC checked (so only the learner makes sessions)."""

    def __init__(self, started_ns: Optional[int] = None):
        start = time.time_ns() if started_ns is None else started_ns
        self.floor = start - int(MAX_CLOCK_SKEW_S * 1e9)
        self._sessions: collections.OrderedDict[str, tuple[int, set]] = collections.OrderedDict()

    def fresh(self, req: Signed) -> bool:
        """Is ``req`` a message its session has not sent before, within the window (then it is remembered)?
        False = a replay."""
        window = int(REPLAY_WINDOW_S * 1e9)
        newest, seen = self._sessions.get(req.session, (self.floor, set()))
        if req.seq <= max(self.floor, newest - window) or req.seq in seen:
            return False
        newest = max(newest, req.seq)
        seen = {s for s in seen if s > newest - window} if len(seen) > 256 else seen
        seen.add(req.seq)
        self._sessions[req.session] = (newest, seen)
        self._sessions.move_to_end(req.session)
        while len(self._sessions) > MAX_SESSIONS:
            self.floor = max(self.floor, self._sessions.popitem(last=False)[1][0])
        return True


def actor_token(secret: bytes, actor_id: int) -> str:
    """Actor ``actor_id``'s token under the run's actor secret."""
    return hmac.new(secret, f"actor {int(actor_id)}".encode(), hashlib.sha256).hexdigest()


def as_actor(secret: bytes, msg: ActorMessage) -> ActorMessage:
    """``msg`` carrying its actor's token (``auth``): what an actor sends."""
    return dataclasses.replace(msg, auth=actor_token(secret, msg.actor_id))


def check_actor(secret: bytes, msg: ActorMessage) -> str:
    """Why ``msg`` does not speak for its ``actor_id``: "no_credential", "bad_credential", or "" (it does)."""
    if not msg.auth:
        return "no_credential"
    return "" if hmac.compare_digest(actor_token(secret, msg.actor_id), msg.auth) else "bad_credential"
