"""The one message schema: every message that crosses a process boundary, and its wire format (a msgpack header
frame, then one raw frame per numpy array). Decoding trusts nothing: every field, dtype, shape and size is checked
before ``np.frombuffer``, then the message's ``validate()``; any failure raises ``MalformedMessage(reason)``.
Nothing is unpickled. Details: docs/CONTRACTS.md "Messages".
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence, Union

import msgpack
import numpy as np

SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_ARRAY_RANK = 5
ALLOWED_DTYPES = frozenset({"uint8", "bool", "int32", "int64", "float16", "float32", "float64"})


class MalformedMessage(ValueError):
    """A frame sequence that is not a valid message. ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# Arrays declared per message class: name -> (dtype, ndim, optional).
ArraySpec = dict[str, tuple[str, int, bool]]


@dataclass
class Message:
    """Base class. Subclasses set KIND, SCALARS (name -> allowed python types) and ARRAYS."""

    KIND: ClassVar[str] = ""
    SCALARS: ClassVar[dict[str, tuple[type, ...]]] = {}
    ARRAYS: ClassVar[ArraySpec] = {}

    def validate(self) -> None:
        """Cross-field checks; raise MalformedMessage. Default: nothing beyond the typed fields."""


_INT = (int,)
_FLOAT = (float, int)
_STR = (str,)
_BOOL = (bool,)
_DICT = (dict,)
_LIST = (list,)


@dataclass(frozen=True)
class PolicyTag:
    """Which policy made something: the learner lineage it comes from and its version there. A lineage is one
    learner start (an id every rank of it agrees on); ``ROOT`` ("") is the initial policy every fresh learner
    starts from, so data sampled before any learner published is ("", 0). Versions count on along a lineage's
    history (a resumed learner continues from its checkpoint's version), so lags compare version numbers."""

    lineage: str
    version: int

    def __str__(self) -> str:
        return f"{self.lineage[:8] or 'root'}:v{self.version}"


ROOT = ""
MAX_FORKS = 8               # ancestors a lineage remembers (older data is far past any eta)
_LINEAGE_ID = re.compile(r"[0-9a-z]{0,32}")


@dataclass(frozen=True)
class Lineage:
    """A learner's history: its own id and, newest first, the policies it descends from - (ancestor, the version
    it was resumed at): a fresh learner descends from (ROOT, 0), one resumed from a checkpoint written by lineage
    L at version c from (L, c) and L's ancestors. Every policy of the history is the live learner's; anything
    else (a dead learner's versions past the checkpoint its successor resumed from) is not."""

    id: str
    forks: tuple[PolicyTag, ...] = ()

    def holds(self, tag: PolicyTag) -> bool:
        """Is ``tag`` a policy of this history? Any version of our own lineage (a version we have not reached
        yet is the caller's to judge); an ancestor's up to where the line left it (its fork, and every later
        fork below that)."""
        if tag.lineage == self.id:
            return True
        limit = None
        for fork in self.forks:
            limit = fork.version if limit is None else min(limit, fork.version)
            if fork.lineage == tag.lineage:
                return tag.version <= limit
        return False

    def descend(self, new_id: str, version: int) -> "Lineage":
        """The lineage of a learner started as ``new_id`` from this one's weights at ``version``."""
        return Lineage(new_id, ((PolicyTag(self.id, int(version)),) + self.forks)[:MAX_FORKS])

    def encode(self) -> str:
        """``"<id> <ancestor>@<version> ..."`` (BatchRequest.lineage, checkpoints, the buffer's journal)."""
        return " ".join([self.id] + [f"{f.lineage}@{f.version}" for f in self.forks])

    @classmethod
    def parse(cls, text: str) -> "Lineage":
        """Inverse of ``encode``; ``MalformedMessage("lineage")`` for anything else."""
        parts = text.split(" ")
        forks = []
        for part in parts[1:]:
            lineage, _, version = part.partition("@")
            if not version.isdigit() or len(version) > 18 or not _LINEAGE_ID.fullmatch(lineage):
                raise MalformedMessage("lineage", f"bad ancestor {part[:40]!r}")
            forks.append(PolicyTag(lineage, int(version)))
        if not _LINEAGE_ID.fullmatch(parts[0]) or len(forks) > MAX_FORKS:
            raise MalformedMessage("lineage", f"bad lineage {text[:80]!r}")
        return cls(parts[0], tuple(forks))


MAX_PHASES = 32           # phases one process reports (a process has about ten)
MAX_PHASE_NAME = 32


def _check_phases(phases: dict) -> None:
    """A ``PhaseClock.seconds()`` as received: a few short names, each a finite, non-negative number of seconds."""
    if len(phases) > MAX_PHASES:
        raise MalformedMessage("value", f"{len(phases)} phases > {MAX_PHASES}")
    for name, s in phases.items():
        if not (isinstance(name, str) and 0 < len(name) <= MAX_PHASE_NAME and isinstance(s, (int, float))
                and not isinstance(s, bool) and math.isfinite(s) and s >= 0):
            raise MalformedMessage("value", "phases must map a short name to finite seconds >= 0")


@dataclass
class Trajectory(Message):
    """One finished rollout: what the learner needs to recompute log-probs and build the loss."""

    KIND: ClassVar[str] = "trajectory"
    SCALARS: ClassVar[dict] = {
        "run_id": _STR, "actor_id": _INT, "group_id": _STR, "traj_id": _STR, "task_id": _INT,
        "init_state_id": _INT, "instruction": _STR, "behaviour_version": _INT, "success": _BOOL,
        "reward": _FLOAT, "env_steps": _INT, "t_start": _FLOAT, "t_end": _FLOAT, "group_size": _INT,
        "lineage": _STR,
    }
    ARRAYS: ClassVar[ArraySpec] = {
        "chunk_versions": ("int64", 1, False),   # [N] policy version that produced each policy call
        "images": ("uint8", 4, False),           # [N, H, W, 3] observation at each policy call
        "proprio": ("float32", 2, False),        # [N, P]
        "action_tokens": ("int64", 2, False),    # [N, T] token ids (T = chunk x dof)
        "behav_logprobs": ("float32", 2, False), # [N, T] log-probs at the rollout temperature
        "token_mask": ("bool", 2, False),        # [N, T] False for tokens never executed (episode ended)
        "wrist_images": ("uint8", 4, True),      # [N, H, W, 3] or None
    }

    run_id: str
    actor_id: int
    group_id: str
    traj_id: str
    task_id: int
    init_state_id: int
    instruction: str
    behaviour_version: int
    success: bool
    reward: float
    env_steps: int
    t_start: float
    t_end: float
    group_size: int
    chunk_versions: np.ndarray
    images: np.ndarray
    proprio: np.ndarray
    action_tokens: np.ndarray
    behav_logprobs: np.ndarray
    token_mask: np.ndarray
    wrist_images: Optional[np.ndarray] = None
    lineage: str = ROOT
    """The learner lineage of every policy call (an actor changes lineage only between groups)."""

    @property
    def tag(self) -> PolicyTag:
        """The oldest policy that sampled it (what its lag is measured from)."""
        return PolicyTag(self.lineage, self.behaviour_version)

    @property
    def num_calls(self) -> int:
        return int(self.action_tokens.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = (self.chunk_versions, self.images, self.proprio, self.action_tokens, self.behav_logprobs,
                  self.token_mask, self.wrist_images)
        return sum(a.nbytes for a in arrays if a is not None)

    def validate(self) -> None:
        n = self.action_tokens.shape[0]
        if n < 1:
            raise MalformedMessage("shape", "trajectory has no policy calls")
        for name in ("chunk_versions", "images", "proprio", "behav_logprobs", "token_mask"):
            if getattr(self, name).shape[0] != n:
                raise MalformedMessage("shape", f"{name} has {getattr(self, name).shape[0]} calls, tokens have {n}")
        if self.behav_logprobs.shape != self.action_tokens.shape or self.token_mask.shape != self.action_tokens.shape:
            raise MalformedMessage("shape", "behav_logprobs/token_mask must match action_tokens")
        if self.images.shape[-1] != 3:
            raise MalformedMessage("shape", f"images must be [N,H,W,3], got {self.images.shape}")
        if self.wrist_images is not None and self.wrist_images.shape[0] != n:
            raise MalformedMessage("shape", "wrist_images call count differs")
        if self.group_size < 2:
            raise MalformedMessage("value", f"group_size {self.group_size} < 2")
        # Few numpy calls (this runs on every received trajectory): the min decides both version checks, and the
        # min and max of the valid log-probs are finite and <= 0 exactly when every one is (NaN propagates).
        first = int(self.chunk_versions.min())
        if self.behaviour_version < 0 or first < 0:
            raise MalformedMessage("negative_version")
        if first != self.behaviour_version:
            raise MalformedMessage("version_mismatch", "behaviour_version must be min(chunk_versions)")
        if not self.token_mask.any():
            raise MalformedMessage("value", "no valid action token")
        valid = self.behav_logprobs[self.token_mask]
        lo, hi = float(valid.min()), float(valid.max())
        if not (math.isfinite(lo) and math.isfinite(hi) and hi <= 1e-4):
            raise MalformedMessage("bad_logprob", "behaviour log-probs must be finite and <= 0")
        if self.proprio.dtype.kind == "f" and not np.isfinite(self.proprio).all():
            # A simulator blow-up: NaN state would make every learner step on this batch non-finite.
            raise MalformedMessage("bad_proprio", "proprio must be finite")
        if self.env_steps < 0 or not math.isfinite(self.reward):
            raise MalformedMessage("value", "env_steps must be >= 0 and reward finite")
        if not _LINEAGE_ID.fullmatch(self.lineage):
            raise MalformedMessage("lineage", f"bad lineage id {self.lineage[:40]!r}")


@dataclass
class GrantRequest(Message):
    """Actor -> buffer: may I start ``want`` new groups?"""

    KIND: ClassVar[str] = "grant_request"
    SCALARS: ClassVar[dict] = {"actor_id": _INT, "want": _INT, "policy_version": _INT, "policy_lineage": _STR,
                               "auth": _STR}
    actor_id: int
    want: int = 1
    policy_version: int = 0
    policy_lineage: str = ROOT
    auth: str = ""      # the actor's token under the run's actor secret (async_vla/learner_secret.py)

    @property
    def policy(self) -> PolicyTag:
        """The weights the actor would sample the groups with."""
        return PolicyTag(self.policy_lineage, self.policy_version)


@dataclass
class AdmissionGrant(Message):
    """Buffer -> actor: start these groups (ids issued by the buffer, so it can count them in flight), or none and
    why (``refused``: "wait" = ask again after retry_after_s; "behind" = the actor's weights lag the learner by
    more than max_staleness, "dead" = they are not the learner's: either way load the learner's newest first;
    "unauthenticated" = the request's actor id did not authenticate, ``error`` says why)."""

    KIND: ClassVar[str] = "admission_grant"
    SCALARS: ClassVar[dict] = {"actor_id": _INT, "group_ids": _LIST, "learner_version": _INT,
                               "learner_lineage": _STR, "max_staleness": _INT, "retry_after_s": _FLOAT,
                               "refused": _STR, "error": _STR, "buffer_id": _STR}
    actor_id: int
    group_ids: list = field(default_factory=list)
    learner_version: int = 0
    learner_lineage: str = ROOT
    max_staleness: int = 0
    retry_after_s: float = 0.0
    refused: str = ""               # "" (granted), "wait", "behind", "dead" or "unauthenticated" (see above)
    error: str = ""                 # the request itself was out of bounds (want < 1, or above what it may hold)
    buffer_id: str = ""             # the buffer incarnation answering (a restarted buffer has a new one)

    def validate(self) -> None:
        if not all(isinstance(g, str) for g in self.group_ids):
            raise MalformedMessage("type", "group_ids must be strings")


@dataclass
class Heartbeat(Message):
    """Actor -> buffer/fleet: alive, with its current policy version and state."""

    KIND: ClassVar[str] = "heartbeat"
    SCALARS: ClassVar[dict] = {"actor_id": _INT, "pid": _INT, "policy_version": _INT, "state": _STR, "t": _FLOAT,
                               "auth": _STR}
    actor_id: int
    pid: int = 0
    policy_version: int = 0
    state: str = "running"
    t: float = field(default_factory=time.time)
    auth: str = ""      # the actor's token (as GrantRequest.auth)


@dataclass
class ActorStats(Message):
    """Actor -> buffer -> TensorBoard: throughput and success by task over the last interval, and the actor's
    seconds by phase since it started (``PhaseClock.seconds``: they sum to its wall time)."""

    KIND: ClassVar[str] = "actor_stats"
    SCALARS: ClassVar[dict] = {"actor_id": _INT, "interval_s": _FLOAT, "env_steps": _INT, "policy_calls": _INT,
                               "phases": _DICT, "episodes": _INT,
                               "successes_by_task": _DICT, "episodes_by_task": _DICT, "policy_version": _INT,
                               "env_crashes": _INT, "auth": _STR}
    actor_id: int
    interval_s: float = 0.0
    env_steps: int = 0
    policy_calls: int = 0
    phases: dict = field(default_factory=dict)
    episodes: int = 0
    successes_by_task: dict = field(default_factory=dict)
    episodes_by_task: dict = field(default_factory=dict)
    policy_version: int = 0
    env_crashes: int = 0
    auth: str = ""      # the actor's token (as GrantRequest.auth)

    def validate(self) -> None:
        for d in (self.successes_by_task, self.episodes_by_task):
            if not all(isinstance(k, str) and isinstance(v, int) for k, v in d.items()):
                raise MalformedMessage("type", "by-task counters must map str -> int")
        _check_phases(self.phases)


@dataclass
class BatchRequest(Message):
    """Learner rank -> buffer: my share of the next batch, at learner version ``version``; and this rank's seconds by
    phase so far (``PhaseClock.seconds``; reporting only, outside the signature)."""

    KIND: ClassVar[str] = "batch_request"
    SCALARS: ClassVar[dict] = {"rank": _INT, "world": _INT, "version": _INT, "timeout_s": _FLOAT, "lineage": _STR,
                               "session": _STR, "seq": _INT, "auth": _STR, "phases": _DICT}
    rank: int
    world: int
    version: int
    timeout_s: float = 1.0
    lineage: str = ""   # the learner's Lineage, encoded ("": not told; the buffer keeps the one it follows)
    session: str = ""   # the signing process's session and its message counter, inside the MAC (no replays)
    seq: int = 0
    auth: str = ""      # HMAC of the fields with the run's learner secret (async_vla/learner_secret.py)
    phases: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.lineage:
            Lineage.parse(self.lineage)
        _check_phases(self.phases)


@dataclass
class BatchHeader(Message):
    """Buffer -> learner rank: the next ``len(group_sizes)`` groups follow as trajectories (or none yet)."""

    KIND: ClassVar[str] = "batch_header"
    SCALARS: ClassVar[dict] = {"batch_id": _INT, "group_sizes": _LIST, "version": _INT, "ready": _BOOL}
    batch_id: int
    group_sizes: list = field(default_factory=list)
    version: int = 0
    ready: bool = False


@dataclass
class ControlCommand(Message):
    """Operator or learner -> buffer: change a live knob (e.g. max_staleness) or report the learner version."""

    KIND: ClassVar[str] = "control"
    SCALARS: ClassVar[dict] = {"command": _STR, "value": (int, float, str, type(None)), "session": _STR,
                               "seq": _INT, "auth": _STR}
    command: str
    value: Any = None
    session: str = ""   # set_max_staleness: signing session and counter (as BatchRequest's)
    seq: int = 0
    auth: str = ""      # set_max_staleness: HMAC with the run's learner secret (async_vla/learner_secret.py)


@dataclass
class Shutdown(Message):
    """Anyone -> anyone: stop cleanly."""

    KIND: ClassVar[str] = "shutdown"
    SCALARS: ClassVar[dict] = {"reason": _STR}
    reason: str = ""


@dataclass
class WeightsFetch(Message):
    """Actor -> weights file server: bytes from ``offset`` (at most ``max_bytes``) of the export ``name``
    (``""`` = whatever ``latest`` points at now)."""

    KIND: ClassVar[str] = "weights_fetch"
    SCALARS: ClassVar[dict] = {"name": _STR, "offset": _INT, "max_bytes": _INT}
    name: str = ""
    offset: int = 0
    max_bytes: int = 8 * 1024**2

    def validate(self) -> None:
        if self.offset < 0 or self.max_bytes < 1 or "/" in self.name or self.name.startswith("."):
            raise MalformedMessage("value", "weights_fetch: offset >= 0, max_bytes >= 1, a plain file name")


@dataclass
class WeightsChunk(Message):
    """Weights file server -> actor: ``data`` = bytes [offset, offset + len) of export ``name`` (``total`` bytes,
    the policy ``lineage`` / ``version``); ``name`` "" = no export yet; ``error`` says why a request was refused."""

    KIND: ClassVar[str] = "weights_chunk"
    SCALARS: ClassVar[dict] = {"name": _STR, "version": _INT, "offset": _INT, "total": _INT, "error": _STR,
                               "lineage": _STR}
    ARRAYS: ClassVar[ArraySpec] = {"data": ("uint8", 1, False)}
    name: str
    version: int
    offset: int
    total: int
    data: np.ndarray
    error: str = ""
    lineage: str = ROOT


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Trajectory, GrantRequest, AdmissionGrant, Heartbeat, ActorStats, BatchRequest,
                BatchHeader, ControlCommand, Shutdown, WeightsFetch, WeightsChunk)
}

Frame = Union[bytes, memoryview, Any]  # bytes, memoryview or zmq.Frame (has .buffer)


def encode(msg: Message) -> list:
    """Message -> [header bytes, array frames...]. Arrays are sent as contiguous buffers (no copy if possible)."""
    scalars = {name: getattr(msg, name) for name in msg.SCALARS}
    specs, frames = [], []
    for name in msg.ARRAYS:
        arr = getattr(msg, name)
        if arr is None:
            continue
        arr = np.ascontiguousarray(arr)
        specs.append([name, arr.dtype.name, list(arr.shape)])
        frames.append(memoryview(arr).cast("B") if arr.nbytes else b"")
    header = msgpack.packb({"v": SCHEMA_VERSION, "k": msg.KIND, "f": scalars, "a": specs}, use_bin_type=True)
    return [header, *frames]


def frames_of(msg: Message) -> list:
    """The frames ``msg`` travels as: those it was decoded from, unchanged (zero-copy: a received ``zmq.Frame`` is
    sent again by reference), else ``encode(msg)``. Sound because a decoded message is never modified in place:
    a changed copy (``dataclasses.replace``) is a new object without received frames."""
    frames = msg.__dict__.get("_received")
    return list(frames) if frames is not None else encode(msg)


def _buffer(frame: Frame) -> memoryview:
    if hasattr(frame, "buffer"):
        return frame.buffer  # zmq.Frame received with copy=False
    return memoryview(frame)


def _check_scalar(cls: type[Message], name: str, value: Any) -> Any:
    allowed = cls.SCALARS[name]
    # bool is an int subclass: never accept True where a count or version is expected.
    if isinstance(value, bool) and bool not in allowed:
        raise MalformedMessage("type", f"{name} must be {allowed}, got bool")
    if not isinstance(value, allowed):
        raise MalformedMessage("type", f"{name} must be {[t.__name__ for t in allowed]}, got {type(value).__name__}")
    if isinstance(value, float) and float in allowed and not math.isfinite(value):
        raise MalformedMessage("value", f"{name} is not finite")
    return value


def _scalar_layout(cls: type[Message]) -> tuple[tuple[str, bool], ...]:
    """(scalar field, required?) in dataclass order."""
    return tuple((f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if f.name in cls.SCALARS)


_ITEMSIZE = {d: np.dtype(d).itemsize for d in ALLOWED_DTYPES}
# Computed once per class, not per message (decode runs hundreds of times per second).
_LAYOUT = {cls: _scalar_layout(cls) for cls in MESSAGE_TYPES.values()}


def _decode_array(spec: Any, buf: memoryview, expected: ArraySpec, max_bytes: int) -> tuple[str, np.ndarray]:
    if not (type(spec) is list and len(spec) == 3 and type(spec[0]) is str and type(spec[1]) is str
            and type(spec[2]) is list):
        raise MalformedMessage("header", "array spec must be [name, dtype, shape]")
    name, dtype, shape = spec
    want = expected.get(name)
    if want is None:
        raise MalformedMessage("unknown_field", name)
    want_dtype, want_ndim, _ = want
    if dtype not in ALLOWED_DTYPES or dtype != want_dtype:
        raise MalformedMessage("dtype", f"{name}: {dtype} (expected {want_dtype})")
    # type(d) is int: plain ints only (msgpack gives nothing else), so never a bool.
    if (len(shape) != want_ndim or len(shape) > MAX_ARRAY_RANK
            or not all(type(d) is int and 0 <= d < 2**31 for d in shape)):
        raise MalformedMessage("shape", f"{name}: {shape} (expected rank {want_ndim})")
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]  # python ints: no overflow
    if nbytes > max_bytes or nbytes != buf.nbytes:
        raise MalformedMessage("size_mismatch", f"{name}: shape {shape} needs {nbytes} B, frame has {buf.nbytes}")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes else np.zeros(shape, dtype=dtype)
    return name, arr


def decode(frames: Sequence[Frame], max_bytes: int = 64 * 1024**2) -> Message:
    """[header, arrays...] -> validated Message, or raise MalformedMessage (never anything else).
    The message keeps ``frames`` for ``frames_of``."""
    if not frames:
        raise MalformedMessage("empty")
    try:
        return _decode(frames, max_bytes)
    except MalformedMessage:
        raise
    except Exception as exc:  # noqa: BLE001 - any surprise in hostile input is still "malformed", never a crash
        raise MalformedMessage("invalid", f"{type(exc).__name__}: {exc}") from None


def _decode(frames: Sequence[Frame], max_bytes: int) -> Message:
    bufs = [_buffer(f) for f in frames]
    head = bufs[0]
    if head.nbytes > MAX_HEADER_BYTES:
        raise MalformedMessage("oversize", f"header {head.nbytes} B")
    total = sum(b.nbytes for b in bufs)
    if total > max_bytes:
        raise MalformedMessage("oversize", f"{total} B > {max_bytes} B")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True,
                                 max_array_len=4096, max_map_len=256, max_str_len=MAX_HEADER_BYTES)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
        raise MalformedMessage("msgpack", type(exc).__name__) from None
    if not isinstance(header, dict) or not {"v", "k", "f", "a"} <= header.keys():
        raise MalformedMessage("header", "not a message header")
    if header["v"] != SCHEMA_VERSION:
        raise MalformedMessage("schema_version", f"got {header['v']!r}, speak {SCHEMA_VERSION}")
    cls = MESSAGE_TYPES.get(header["k"]) if isinstance(header["k"], str) else None
    if cls is None:
        raise MalformedMessage("unknown_kind", repr(header["k"])[:64])
    fields_in, specs = header["f"], header["a"]
    if not isinstance(fields_in, dict) or not isinstance(specs, list):
        raise MalformedMessage("header", "f must be a map and a a list")
    if len(specs) != len(frames) - 1:
        raise MalformedMessage("frame_count", f"{len(specs)} arrays declared, {len(frames) - 1} frames")
    if not fields_in.keys() <= cls.SCALARS.keys():
        unknown = set(fields_in) - set(cls.SCALARS)
        raise MalformedMessage("unknown_field", ",".join(sorted(map(str, unknown)))[:64])
    kwargs: dict[str, Any] = {}
    for name, required in _LAYOUT[cls]:
        if name in fields_in:
            kwargs[name] = _check_scalar(cls, name, fields_in[name])
        elif required:
            raise MalformedMessage("missing_field", name)
    for spec, buf in zip(specs, bufs[1:]):
        name, arr = _decode_array(spec, buf, cls.ARRAYS, max_bytes)
        if name in kwargs:
            raise MalformedMessage("header", f"array {name} twice")
        kwargs[name] = arr
    for name, (_, _, optional) in cls.ARRAYS.items():
        if name not in kwargs and not optional:
            raise MalformedMessage("missing_field", name)
    msg = cls(**kwargs)
    msg.validate()
    msg._received = tuple(frames)   # not a dataclass field: equality, repr and replace() never see it
    return msg


def encode_bundle(header: Message, members: Sequence[Message]) -> list:
    """A header message followed by several messages in one multipart: [n_frames...] prefix frame.
    Members travel as ``frames_of`` them: a trajectory the buffer received is forwarded as it came."""
    parts = [encode(header)] + [frames_of(m) for m in members]
    counts = msgpack.packb([len(p) for p in parts])
    return [counts] + [f for p in parts for f in p]


def decode_bundle(frames: Sequence[Frame], max_bytes: int = 1024**3) -> tuple[Message, list[Message]]:
    """Inverse of encode_bundle; validates every member."""
    try:
        counts = msgpack.unpackb(_buffer(frames[0]), max_array_len=100_000)
    except Exception:  # noqa: BLE001
        raise MalformedMessage("msgpack", "bundle prefix") from None
    if (not isinstance(counts, list) or not counts or not all(isinstance(c, int) and c >= 1 for c in counts)
            or sum(counts) != len(frames) - 1):
        raise MalformedMessage("frame_count", "bundle prefix does not match frames")
    out, pos = [], 1
    for c in counts:
        out.append(decode(frames[pos:pos + c], max_bytes))
        pos += c
    return out[0], out[1:]
