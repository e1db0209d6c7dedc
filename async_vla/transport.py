"""Small ZeroMQ wrappers (and an in-process twin with the same interface) for every channel: trajectories (actors
PUSH -> buffer PULL, back-pressure through high-water marks), control (buffer ROUTER <-> actors and operators DEALER)
and batch (the same classes on a socket and I/O thread of its own). Receivers count bad input in ``malformed`` by
reason and never raise; sockets bind to 127.0.0.1 unless configured otherwise, linger so close() never hangs and cap
message size (MAXMSGSIZE). The channels: docs/CONTRACTS.md "Protocol".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Deque, Optional, Sequence

import zmq

from async_vla.messages import MalformedMessage, Message, decode, decode_bundle, encode, encode_bundle

log = logging.getLogger(__name__)

LINGER_MS = 200
MONITOR_READ_S = 0.1   # the receiver's connection events are read at least this often while it receives


@dataclass
class CurveKeys:
    """CURVE material: the server's key pair, the clients' key pair, and the allowed client keys dir."""

    server_public: bytes
    server_secret: Optional[bytes]
    client_public: Optional[bytes]
    client_secret: Optional[bytes]
    authorized_dir: Optional[str]

    @classmethod
    def load(cls, directory: str, role: str) -> "CurveKeys":
        """role 'server' needs server.key_secret; role 'client' needs server.key and client.key_secret."""
        import zmq.auth

        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"transport.curve_dir {directory!r} does not exist: run bin/keys {directory}")
        server_public, server_secret = zmq.auth.load_certificate(
            d / ("server.key_secret" if role == "server" else "server.key"))
        client_public = client_secret = None
        if role == "client":
            client_public, client_secret = zmq.auth.load_certificate(d / "client.key_secret")
        return cls(server_public, server_secret, client_public, client_secret, str(d / "authorized"))


class Authenticator:
    """ZAP handler for a context: only clients whose public key is in ``authorized_dir`` get in."""

    def __init__(self, context: zmq.Context, keys: CurveKeys):
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=keys.authorized_dir)

    def stop(self) -> None:
        self._auth.stop()


def _secure_server(sock: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    if keys is not None:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    """Make ``sock`` a CURVE client of the buffer with ``keys`` (its own pair and the server's public key); None:
    plain ZeroMQ (transport.curve=false). Before ``connect``."""
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


def _close_quietly(sock: zmq.Socket, ctx: Optional[zmq.Context], extra: tuple = ()) -> None:
    with contextlib.suppress(Exception):
        if extra:   # monitor sockets: stop the events first, or a later one blocks libzmq's I/O thread for good
            sock.disable_monitor()
        for other in extra:
            other.close(linger=0)
        sock.close(linger=0)
        if ctx is not None:
            ctx.term()


def _guard_collection(owner: object, sock: zmq.Socket, ctx: zmq.Context, own_ctx: bool,
                      extra: tuple = ()) -> weakref.finalize:
    """Close ``sock`` (and term an owned ``ctx``) when ``owner`` is collected without close(): a leaked socket
    and its context collected together in a reference cycle would deadlock the garbage collector (pyzmq's
    Context.__del__ no longer sees the socket; a weakref.finalize runs before it). ``close()`` detaches it; at
    interpreter exit it does nothing. ``extra``: sockets of the same context to close first (a socket monitor)."""
    fin = weakref.finalize(owner, _close_quietly, sock, ctx if own_ctx else None, extra)
    fin.atexit = False
    return fin


def _socket(ctx: zmq.Context, kind: int, hwm: int, max_bytes: Optional[int]) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = LINGER_MS
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    if max_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))
    return sock


class MalformedCounter:
    """Counts dropped input by reason (thread-safe enough for counters read by a metrics thread)."""

    def __init__(self) -> None:
        self.by_reason: collections.Counter = collections.Counter()
        self.total = 0
        """All counted so far (a reader polling for news compares this, not the Counter)."""

    def add(self, reason: str) -> None:
        self.by_reason[reason] += 1
        self.total += 1


def _decode_counted(frames: list, max_bytes: int, malformed: MalformedCounter, decoder=decode):
    """``decoder(frames)``, or None with the reason counted in ``malformed``."""
    try:
        return decoder(frames, max_bytes)
    except MalformedMessage as exc:
        malformed.add(exc.reason)
        return None


class _Endpoint:
    """One socket of ``kind`` in ``ctx`` (or in a context of its own, termed on close), closed if collected."""

    def __init__(self, kind: int, hwm: int, max_bytes: Optional[int], ctx: Optional[zmq.Context],
                 monitor_events: int = 0):
        self._ctx, self._own_ctx = (ctx, False) if ctx is not None else (zmq.Context(), True)
        self._sock = _socket(self._ctx, kind, hwm, max_bytes)
        extra = ()
        if monitor_events:
            self._monitor = self._sock.get_monitor_socket(monitor_events)
            extra = (self._monitor,)
        self._collect_guard = _guard_collection(self, self._sock, self._ctx, self._own_ctx, extra)

    def close(self, linger_ms: Optional[int] = None) -> None:
        self._collect_guard.detach()
        self._sock.close(linger=linger_ms)
        if self._own_ctx:
            self._ctx.term()


class TrajectorySender(_Endpoint):
    """Actor side of the trajectory channel (PUSH, connects)."""

    def __init__(self, endpoint: str, hwm: int = 64, ctx: Optional[zmq.Context] = None,
                 keys: Optional[CurveKeys] = None):
        super().__init__(zmq.PUSH, hwm, None, ctx)
        secure_client(self._sock, keys)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, msg: Message, timeout_s: Optional[float] = None) -> bool:
        """Send or wait for room; False if the receiver stayed full for ``timeout_s`` (None = wait forever)."""
        return self.send_frames(encode(msg), timeout_s)

    def send_frames(self, frames: Sequence, timeout_s: Optional[float] = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                # NOBLOCK: POLLOUT can be stale by the time we send (a peer whose CURVE handshake fails gets its
                # pipe torn down in between), and a blocking send would then wait forever, past any timeout.
                # A multipart message is queued atomically: it fails on the first frame or not at all.
                # copy=False keeps images zero-copy; encode() made fresh contiguous views, never mutated later.
                self._sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            wait_ms = 100 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if deadline is not None and wait_ms <= 0:
                return False
            if self._sock.poll(min(wait_ms, 100), zmq.POLLOUT):
                time.sleep(0.001)   # ready but refused just now: do not spin on a pipe that comes and goes

    def close(self, flush_s: float = 5.0) -> None:
        """Close after giving queued trajectories up to ``flush_s`` to leave (a plain close would drop them).
        Terminating our own context waits for the flush: with zero-copy sends, exiting while ZeroMQ's I/O thread
        still reads the arrays would crash the process."""
        super().close(int(flush_s * 1000))


class TrajectoryReceiver(_Endpoint):
    """Buffer side of the trajectory channel (PULL, binds). Bad frames are counted, never raised."""

    def __init__(self, endpoint: str, hwm: int = 64, max_bytes: int = 64 * 1024**2,
                 ctx: Optional[zmq.Context] = None, keys: Optional[CurveKeys] = None):
        # Connection events only (a handful per actor lifetime): what the memory bound counts (each connection may
        # hold up to hwm trajectories in its queue).
        super().__init__(zmq.PULL, hwm, max_bytes, ctx, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        _secure_server(self._sock, keys)
        self.endpoint = bind(self._sock, endpoint)
        self._connections = 0
        self._monitor_read_at = time.monotonic()
        self.max_bytes = max_bytes
        self.malformed = MalformedCounter()
        self.received = 0

    @property
    def socket(self) -> zmq.Socket:
        """The PULL socket, to register in a caller's ``zmq.Poller`` (read it through ``recv``)."""
        return self._sock

    @property
    def connections(self) -> int:
        """Peers connected now: accepted minus disconnected, from ZeroMQ's socket monitor (read when asked)."""
        from zmq.utils.monitor import recv_monitor_message

        self._monitor_read_at = time.monotonic()
        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)["event"]
            self._connections += 1 if event == zmq.EVENT_ACCEPTED else -1
        return self._connections

    def recv(self, timeout_s: float = 0.0) -> Optional[Message]:
        """One valid message, or None after ``timeout_s`` (malformed ones are counted and skipped)."""
        deadline = time.monotonic() + timeout_s
        if deadline - self._monitor_read_at > MONITOR_READ_S:
            # libzmq's I/O thread blocks on a full monitor queue (~2,000 events), and with it this socket's intake:
            # a connect/disconnect storm must not wait for the next metrics report to be read
            self.connections  # noqa: B018 (reads the events)
        while True:
            try:   # try first, poll only when empty: under load the socket is seldom empty (one syscall saved)
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                remaining = max(0, int((deadline - time.monotonic()) * 1000))
                if not remaining or not self._sock.poll(remaining, zmq.POLLIN):
                    return None
                continue
            self.received += 1
            msg = _decode_counted(frames, self.max_bytes, self.malformed)
            if msg is not None:
                return msg
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.connections  # noqa: B018 (empty the monitor queue: disable_monitor waits while it is full)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        super().close()


class ControlServer(_Endpoint):
    """Buffer side of the control channel (ROUTER, binds): requests from many peers, replies by identity."""

    def __init__(self, endpoint: str, hwm: int = 1024, max_bytes: int = 1024**2,
                 ctx: Optional[zmq.Context] = None, keys: Optional[CurveKeys] = None):
        super().__init__(zmq.ROUTER, hwm, max_bytes, ctx)
        self._sock.router_mandatory = False  # a vanished peer's reply is dropped, never an error
        _secure_server(self._sock, keys)
        self.endpoint = bind(self._sock, endpoint)
        self.max_bytes = max_bytes
        self.malformed = MalformedCounter()
        self._curve = keys is not None
        self.user_id = ""
        """The ZAP User-Id (the client's CURVE public key, Z85) of the message ``recv`` returned last; "" without
        CURVE."""

    def recv(self, timeout_s: float = 0.0) -> Optional[tuple[bytes, Message]]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(remaining, zmq.POLLIN):
                return None
            peer, *frames = self._sock.recv_multipart(copy=False)
            self.user_id = frames[0].get("User-Id") if self._curve and frames else ""
            msg = _decode_counted(frames, self.max_bytes, self.malformed)
            if msg is not None:
                return bytes(peer.buffer), msg
            if time.monotonic() >= deadline:
                return None

    @property
    def socket(self) -> zmq.Socket:
        """The ROUTER socket, to register in a caller's ``zmq.Poller`` (read it through ``recv``)."""
        return self._sock

    def reply(self, peer: bytes, msg: Message) -> None:
        self._sock.send_multipart([peer, *encode(msg)], copy=False)

    def reply_bundle(self, peer: bytes, header: Message, members: Sequence[Message]) -> None:
        self._sock.send_multipart([peer, *encode_bundle(header, members)], copy=False)


class ControlTimeout(TimeoutError):
    """A control request could not be queued, or got no reply, in time (the buffer is down or unreachable)."""


class ControlClient(_Endpoint):
    """Actor / learner side of the control channel (DEALER, connects). Sends never block for longer than asked
    (a DEALER whose queue is full would block forever): ``send`` drops a message whose queue stays full and counts
    it in ``dropped`` by kind (heartbeats, stats); ``request`` / ``call`` raise ``ControlTimeout`` instead."""

    def __init__(self, endpoint: str, identity: Optional[bytes] = None, hwm: int = 1024,
                 max_bytes: int = 1024**3, ctx: Optional[zmq.Context] = None, keys: Optional[CurveKeys] = None):
        super().__init__(zmq.DEALER, hwm, max_bytes, ctx)
        if identity is not None:
            self._sock.identity = identity
        secure_client(self._sock, keys)
        self._sock.connect(endpoint)
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.malformed = MalformedCounter()
        self.dropped = MalformedCounter()
        """Messages ``send`` dropped because the send queue stayed full, by message kind."""

    def _try_send(self, msg: Message, timeout_s: float) -> bool:
        frames = encode(msg)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                # A multipart message is queued atomically: NOBLOCK fails on the first frame or not at all.
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLOUT):
                    return False

    def send(self, msg: Message, timeout_s: float = 0.0) -> bool:
        """Queue ``msg``, waiting at most ``timeout_s`` for room; False = dropped (and counted in ``dropped``)."""
        if self._try_send(msg, timeout_s):
            return True
        self.dropped.add(msg.KIND)
        return False

    def request(self, msg: Message, timeout_s: float) -> None:
        """Queue a message that needs an answer; ``ControlTimeout`` if there is no room within ``timeout_s``."""
        if not self._try_send(msg, timeout_s):
            raise ControlTimeout(f"{msg.KIND}: the control queue to {self.endpoint} stayed full for {timeout_s:.1f} s "
                                 "(buffer down or unreachable)")

    def call(self, msg: Message, timeout_s: float) -> Message:
        """``request`` then wait for the reply; ``ControlTimeout`` if it cannot be sent or no reply comes in time."""
        self.request(msg, timeout_s)
        reply = self.recv(timeout_s)
        if reply is None:
            raise ControlTimeout(f"{msg.KIND}: no reply from {self.endpoint} within {timeout_s:.1f} s")
        return reply

    def recv(self, timeout_s: float = 0.0) -> Optional[Message]:
        return self._recv(timeout_s, decode)

    def recv_bundle(self, timeout_s: float = 0.0) -> Optional[tuple[Message, list[Message]]]:
        return self._recv(timeout_s, decode_bundle)

    def _recv(self, timeout_s: float, decoder):
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return _decode_counted(self._sock.recv_multipart(copy=False), self.max_bytes, self.malformed, decoder)


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; ``tcp://HOST:0`` picks a free port. Returns the endpoint actually bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        host = endpoint[len("tcp://"):-2]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    if endpoint.startswith("ipc://"):
        # created owner-only (<run>/sockets): on a shared host only the run's user can reach the socket files
        Path(endpoint[len("ipc://"):]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock.bind(endpoint)
    return endpoint


def endpoints(transport_cfg, run_directory: Optional[Path] = None, side: str = "bind") -> dict[str, str]:
    """Endpoints of every channel from the transport config (bind side uses host, connect side connect_host)."""
    if transport_cfg.use_ipc:
        if run_directory is None:
            raise ValueError("transport.use_ipc needs a run directory for the socket files")
        base = Path(run_directory).resolve() / "sockets"
        return {"trajectory": f"ipc://{base}/trajectory", "control": f"ipc://{base}/control",
                "batch": f"ipc://{base}/batch"}
    host = transport_cfg.host if side == "bind" else transport_cfg.connect_host
    return {"trajectory": f"tcp://{host}:{transport_cfg.trajectory_port}",
            "control": f"tcp://{host}:{transport_cfg.control_port}",
            "batch": f"tcp://{host}:{transport_cfg.batch_port}"}


class LocalPipe:
    """In-process twin of the trajectory channel (serial mode and tests): same send/recv interface. Messages still
    go through encode/decode; ``capacity`` plays the high-water mark (send returns False when full)."""

    def __init__(self, capacity: int = 64, max_bytes: int = 64 * 1024**2):
        self._queue: Deque[list] = collections.deque()
        self._lock = threading.Condition()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.malformed = MalformedCounter()
        self.received = 0

    def send(self, msg: Message, timeout_s: Optional[float] = None) -> bool:
        return self.send_frames([bytes(f) for f in encode(msg)], timeout_s)

    def send_frames(self, frames: Sequence, timeout_s: Optional[float] = None) -> bool:
        with self._lock:
            ok = self._lock.wait_for(lambda: len(self._queue) < self.capacity, timeout=timeout_s)
            if not ok:
                return False
            self._queue.append([bytes(f) for f in frames])
            self._lock.notify_all()
            return True

    def recv(self, timeout_s: float = 0.0) -> Optional[Message]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if not self._queue and not self._lock.wait_for(
                        lambda: bool(self._queue), timeout=max(0.0, deadline - time.monotonic())):
                    return None
                frames = self._queue.popleft()
                self._lock.notify_all()
                self.received += 1
                msg = _decode_counted(frames, self.max_bytes, self.malformed)
                if msg is not None:
                    return msg

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Nothing to release; present so LocalPipe and the ZeroMQ classes are interchangeable."""
