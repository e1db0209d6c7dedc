"""The buffer as a service: GroupBuffer behind a TrajectoryReceiver (PULL) and two ControlServers (ROUTER), control
(actors' grants, heartbeats and stats, commands) and batch (learner ranks' BatchRequests and their bundles), each
socket with a ZeroMQ context and I/O thread of its own. One thread owns the GroupBuffer (``serve``); every
BatchRequest gets exactly one reply; trajectories are read only while the buffer has room (back-pressure). What
each ``step()`` does and the bounds on control input: docs/CONTRACTS.md "The buffer".
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import zmq

from async_vla.buffer.group_buffer import GroupBuffer
from async_vla.messages import (ActorStats, AdmissionGrant, BatchHeader, BatchRequest, ControlCommand, GrantRequest,
                                Heartbeat, Lineage, Shutdown, Trajectory, frames_of)
from async_vla.buffer.recording import Recorder, recording_info
from async_vla.learner_secret import (ReplayGuard, actor_secret, actor_secret_path, check_actor, learner_secret,
                                      secret_path, verify)
from async_vla.phases import PhaseClock, phase_scalars, phase_table
from async_vla.transport import Authenticator, ControlServer, CurveKeys, TrajectoryReceiver

log = logging.getLogger(__name__)

DRAIN_S = 1.0               # on a clean stop, time given to take in trajectories already queued on the socket
MAX_PARK_S = 600.0          # a learner asking to wait longer is clamped (a reply always comes)
MAX_PARKED = 64             # parked batch requests held at once; beyond it a request is answered not-ready at once
MAX_ACTORS_TRACKED = 4096   # actor ids remembered for metrics and reclaiming (forged ids must not grow memory)
MAX_STATS_TASKS = 512       # by-task entries one ActorStats may carry (a run has far fewer tasks)
CONTROL_BURST = 64          # control messages handled per step before trajectories get a turn
TRAJECTORY_BURST = 256      # trajectories read per step before control gets a turn


M_MMAP_THRESHOLD = -3                 # glibc mallopt parameter
ALLOCATOR_MMAP_THRESHOLD = 32 * 1024**2   # glibc's largest allowed value


def keep_trajectory_memory() -> bool:
    """Have glibc serve trajectory-sized allocations (ZeroMQ's receive buffers) from the heap, reusing freed ones,
    instead of a fresh, page-faulting mmap each (docs/BENCHMARKS.md has the gain). Process-wide; bin/buffer calls it
    once. False where the C library has no ``mallopt`` (not glibc): the buffer works the same, with that cost."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, ALLOCATOR_MMAP_THRESHOLD))


class BufferService:
    """GroupBuffer + sockets + recording + periodic chores. Use as a context manager or call close()."""

    def __init__(self, cfg, run_dir, trajectory_endpoint: str, control_endpoint: str, batch_endpoint: str,
                 valid_task_ids=None, keys: Optional[CurveKeys] = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.previous_ledger = archive_ledger(self.run_dir)
        self._secret = learner_secret(secret_path(cfg.transport, self.run_dir))
        self._actor_secret = actor_secret(actor_secret_path(cfg.transport, self.run_dir))
        self._replay = ReplayGuard()
        self.clock = clock
        bc = cfg.buffer
        self.recorder: Optional[Recorder] = None
        if bc.record:
            meta = {"run_id": cfg.run.name, "max_staleness": cfg.max_staleness,
                    "valid_task_ids": None if valid_task_ids is None else sorted(int(t) for t in valid_task_ids)}
            self.recorder = Recorder(self.run_dir / "recording", bc.record_file_bytes, bc.record_max_files, meta)
        journal = self._journal if self.recorder is not None else None
        self.buffer = GroupBuffer.from_config(cfg, cfg.run.name, clock=clock, valid_task_ids=valid_task_ids, journal=journal)
        ctx = zmq.Context.instance()
        # Ingest and delivery each have a ZeroMQ context, so an I/O thread, of their own: reading megabytes of
        # trajectories and sending batches of hundreds of MB never delay grants and heartbeats on the control socket,
        # nor each other (one I/O thread did all three).
        self._ingest_ctx = zmq.Context(io_threads=1)
        self._delivery_ctx = zmq.Context(io_threads=1)
        self._auths = ([Authenticator(c, keys) for c in (ctx, self._ingest_ctx, self._delivery_ctx)]
                       if keys is not None else [])
        max_bytes = int(cfg.transport.max_message_mb * 1024**2)
        built: list = []
        try:   # a bind that fails (a port in use) must not leave the others' sockets, threads and contexts behind
            self.receiver = TrajectoryReceiver(trajectory_endpoint, hwm=cfg.transport.trajectory_hwm,
                                               max_bytes=max_bytes, ctx=self._ingest_ctx, keys=keys)
            built.append(self.receiver)
            self.control = ControlServer(control_endpoint, ctx=ctx, keys=keys)
            built.append(self.control)
            self.batches = ControlServer(batch_endpoint, ctx=self._delivery_ctx, keys=keys)
        except BaseException:
            self._release(built)
            raise
        self.trajectory_endpoint = self.receiver.endpoint
        self.control_endpoint = self.control.endpoint
        self.batch_endpoint = self.batches.endpoint
        self._full_poll = zmq.Poller()   # idle with no room: wait for control and batch requests only
        for sock in (self.control.socket, self.batches.socket):
            self._full_poll.register(sock, zmq.POLLIN)
        self._idle_poll = zmq.Poller()
        for sock in (self.control.socket, self.batches.socket, self.receiver.socket):
            self._idle_poll.register(sock, zmq.POLLIN)
        self.incarnation = uuid.uuid4().hex[:12]
        """This buffer process's id (AdmissionGrant.buffer_id, ledger.json): actors count what they sent per one."""
        self.counters: collections.Counter = collections.Counter()
        self._parked: list[tuple[bytes, BatchRequest, float]] = []
        self._seen_malformed: collections.Counter = collections.Counter()
        self._seen_malformed_total = 0
        self._actors: dict[int, dict] = {}   # actor_id -> {"t": last message, "heartbeat": ..., "stats": ...}
        self._eta_file = self.run_dir / "control" / "max_staleness"
        self._eta_file.parent.mkdir(parents=True, exist_ok=True)   # so `echo 4 > <run>/control/max_staleness` works
        self._eta_file_sig: Optional[tuple] = None
        self._shutdown = False
        self.accept_shutdown = False
        """A Shutdown message on the control socket stops serve() only when True (a learner thread's embedded
        buffer may allow it); bin/buffer stops on signals: anyone who can reach the socket could send one."""
        self._warned: collections.Counter = collections.Counter()
        self._closed = False
        self.phases = PhaseClock()
        """Where this process's time goes: ``control`` (grants, stats, commands), ``deliver`` (batch requests and
        the batches sent), ``receive`` (reading and checking trajectories), ``admit`` (GroupBuffer.add: assembly,
        filters), ``chores`` (timers: expiry, ledger, metrics), ``idle`` (waiting for input)."""
        self._learner_phases: dict[int, dict] = {}   # rank -> the seconds its last BatchRequest carried
        self.latest_metrics: dict[str, float] = {}
        """metrics() as of the last status tick (logging.status_every_s); the one thing other threads may read."""
        now = clock()
        self._due = {"expire": now, "ledger": now + bc.ledger_every_s, "file": now, "status": now}

    # ------------------------------------------------------------------ loop
    def serve(self, stop_event, on_status: Optional[Callable[[dict], None]] = None) -> None:
        """Serve until ``stop_event`` is set (or a Shutdown message arrives); writes the ledger at exit."""
        log.info("buffer: trajectories on %s, control on %s, batches on %s", self.trajectory_endpoint,
                 self.control_endpoint, self.batch_endpoint)
        try:
            while not stop_event.is_set() and not self._shutdown:
                self.step(on_status=on_status)
        finally:
            self.write_ledger()

    def step(self, wait_s: float = 0.02, on_status: Optional[Callable[[dict], None]] = None) -> int:
        """One round of work; when there was none, waits at most ``wait_s`` for input on any socket (returning as
        soon as some comes: a wait adds no latency, it only bounds how late the timers run). Returns the number of
        messages handled."""
        work = 0
        phase = self.phases.phase
        for server, handle, name in ((self.control, self._handle, "control"),
                                     (self.batches, self._handle_batch, "deliver")):
            with phase(name):
                for _ in range(CONTROL_BURST):
                    got = server.recv(0)
                    if got is None:
                        break
                    handle(*got)
                    work += 1
        added = 0
        for _ in range(TRAJECTORY_BURST):
            if not self.buffer.has_room():
                self.counters["full_steps"] += 1
                break
            with phase("receive"):
                msg = self.receiver.recv(0)
                self._sync_malformed()
            if msg is None:
                break
            with phase("admit"):
                self._on_trajectory(msg)
            added += 1
        work += added
        now = self.clock()
        if self._parked and (added or any(deadline <= now for _, _, deadline in self._parked)):
            with phase("deliver"):
                self._serve_parked(now)
        with phase("chores"):
            if work and self.recorder is not None:
                self.recorder.flush()   # into the OS page cache each busy step: a kill -9 loses no received input
            self._periodic(now, on_status)
        if not work:  # idle: wait until a socket that can make progress has input (the next step reads it)
            poller = self._idle_poll if self.buffer.has_room() else self._full_poll
            with phase("idle"):
                poller.poll(int(wait_s * 1000))
        return work

    def _on_trajectory(self, msg) -> None:
        if isinstance(msg, Trajectory):
            self.buffer.add(msg)
        else:  # a valid message on the wrong channel is still input the books must account for
            self.buffer.count_malformed(f"not_trajectory:{msg.KIND}")

    def _sync_malformed(self) -> None:
        if self.receiver.malformed.total == self._seen_malformed_total:
            return
        by_reason = self.receiver.malformed.by_reason
        for reason, n in by_reason.items():
            for _ in range(n - self._seen_malformed[reason]):
                self.buffer.count_malformed(reason)
        self._seen_malformed = collections.Counter(by_reason)
        self._seen_malformed_total = self.receiver.malformed.total

    def _journal(self, t: float, msg) -> None:
        self.recorder.write(t, frames_of(msg))   # as received: no re-encoding

    # ------------------------------------------------------------------ control channel
    def _handle(self, peer: bytes, msg) -> None:
        if isinstance(msg, (GrantRequest, Heartbeat, ActorStats)) and not self._actor_speaks(peer, msg):
            return
        if isinstance(msg, GrantRequest):
            self._grant(peer, msg)
        elif isinstance(msg, BatchRequest):   # its one reply, at once; the bundle would queue grants behind it
            self.counters["batch_requests_on_control"] += 1
            self._warn("batch_on_control", "buffer: a BatchRequest on the control socket (%s): batches are served "
                       "on the batch socket only (transport.batch_port); answered not ready", self.control_endpoint)
            self.control.reply_bundle(peer, BatchHeader(batch_id=-1, version=msg.version, ready=False), [])
        elif isinstance(msg, ActorStats) and len(msg.episodes_by_task) + len(msg.successes_by_task) > MAX_STATS_TASKS:
            self.counters["actor_stats_refused"] += 1     # kept per actor: its size must be bounded too
        elif isinstance(msg, (Heartbeat, ActorStats)):
            entry = self._touch(msg.actor_id)
            entry.setdefault("key", self.control.user_id)
            entry["heartbeat" if isinstance(msg, Heartbeat) else "stats"] = msg
            if isinstance(msg, ActorStats):   # the run's env steps so far (summary throughput in async mode)
                self.counters["env_steps_reported"] += max(0, int(msg.env_steps))
        elif isinstance(msg, ControlCommand):
            self.control.reply(peer, self._command(msg))
        elif isinstance(msg, Shutdown) and self.accept_shutdown:
            log.info("buffer: shutdown requested (%s)", msg.reason)
            self._shutdown = True
        else:
            self.counters["control_unexpected"] += 1

    def _actor_speaks(self, peer: bytes, msg) -> bool:
        """Does ``msg`` speak for its actor id? Its token must check (the run's actor credential) and, with CURVE,
        it must come from the key (ZAP User-Id) that first spoke for that id. Otherwise it is counted by reason
        (``actor_refused_*``) and nothing else happens: no tracking, no grant (a GrantRequest gets its one reply,
        refused "unauthenticated")."""
        why = check_actor(self._actor_secret, msg)
        user = self.control.user_id
        entry = self._actors.get(msg.actor_id)
        if not why and user and entry is not None and entry.setdefault("key", user) != user:
            why = "other_key"
        if not why:
            return True
        self.counters[f"actor_refused_{why}"] += 1
        self._warn("actor_refused", "buffer: a %s for actor %d that does not authenticate (%s): refused",
                   msg.KIND, msg.actor_id, why)
        if isinstance(msg, GrantRequest):
            self.control.reply(peer, AdmissionGrant(
                actor_id=msg.actor_id, refused="unauthenticated", retry_after_s=self.cfg.buffer.grant_retry_s,
                error=f"actor {msg.actor_id} does not authenticate ({why}): the actor's token comes from the run's "
                      "actor secret (transport.actor_secret_file; async_vla/learner_secret.py)",
                buffer_id=self.incarnation))
        return False

    def _learner_speaks(self, msg) -> str:
        """Why ``msg`` is not the learner's: its MAC (``verify``), or "replayed" (a MAC that checks on a message
        its session already sent or outdid: ``ReplayGuard``); "" = it is, and is remembered."""
        return verify(self._secret, msg) or ("" if self._replay.fresh(msg) else "replayed")

    def _handle_batch(self, peer: bytes, msg) -> None:
        if isinstance(msg, BatchRequest):
            why = self._learner_speaks(msg)
            if why:   # not the learner's: nothing moves (version, lineage, batches); its one reply, not ready
                self.counters[f"learner_refused_{why}"] += 1
                self._warn("learner_refused", "buffer: a batch request without the learner's credential (%s) on %s: "
                           "refused", why, self.batch_endpoint)
                self.batches.reply_bundle(peer, BatchHeader(batch_id=-1, version=msg.version, ready=False), [])
                return
            if msg.phases and 0 <= msg.rank < msg.world:
                self._learner_phases[msg.rank] = msg.phases
            self._batch_request(peer, msg)
        else:
            self.counters["batch_socket_unexpected"] += 1

    def _warn(self, what: str, fmt: str, *args) -> None:
        """A warning that hostile input could repeat without end: the first 10, then every 1000th (counted)."""
        n = self._warned[what] = self._warned[what] + 1
        if n <= 10 or n % 1000 == 0:
            log.warning(fmt + ("" if n <= 10 else f" ({n} such so far)"), *args)

    def _touch(self, actor_id: int) -> dict:
        """The entry of an actor that just spoke. Past MAX_ACTORS_TRACKED the longest-silent actor that holds no
        open group is forgotten; an actor holding a grant is never pushed out by newcomers (only its own silence,
        buffer.reclaim_after_s, reclaims its groups)."""
        entry = self._actors.pop(actor_id, None)
        if entry is None:
            entry = {}
            if len(self._actors) >= MAX_ACTORS_TRACKED:
                # dict order = order of last contact (re-inserted on each): the first without a grant is the oldest
                idle = next((a for a in self._actors if not self.buffer.held_by(a)), None)
                if idle is not None:
                    del self._actors[idle]
                    self.counters["actors_forgotten"] += 1
        self._actors[actor_id] = entry
        entry["t"] = self.clock()
        return entry

    def _live_identities(self) -> int:
        """Actors (authenticated ids) heard from within actor.hung_after_s: who shares the pacing budget."""
        since = self.clock() - self.cfg.actor.hung_after_s
        return sum(1 for e in self._actors.values() if e["t"] >= since)

    def _reclaim(self, actor_id: int, why: str) -> None:
        n = self.buffer.reclaim(actor_id)
        if n:
            self.counters["groups_reclaimed"] += n
            self._warn("reclaim", "buffer: actor %d %s; its %d open groups were taken back", actor_id, why, n)

    def _reclaim_silent(self, now: float) -> None:
        """Reclaim the groups of actors silent for reclaim_after_s; forget actors silent for longer than that and
        hung_after_s (they hold nothing by then)."""
        limit = self.cfg.buffer.reclaim_after_s
        forget = max(limit, self.cfg.actor.hung_after_s)
        for actor_id in self.buffer.actors_holding_grants:
            entry = self._actors.get(actor_id)
            if entry is None or now - entry.get("t", -1e18) > limit:
                self._reclaim(actor_id, f"silent for more than buffer.reclaim_after_s={limit:g} s")
        for actor_id in [a for a, e in self._actors.items() if now - e.get("t", -1e18) > forget]:
            if not self.buffer.held_by(actor_id):
                del self._actors[actor_id]

    def _grant(self, peer: bytes, req: GrantRequest) -> None:
        self.counters["grant_requests"] += 1
        self._touch(req.actor_id).setdefault("key", self.control.user_id)
        bc, error = self.cfg.buffer, ""
        room = bc.max_groups_per_actor - self.buffer.held_by(req.actor_id)
        if req.want < 1:
            error = f"want must be >= 1, got {req.want}"
        elif req.want > room:
            error = (f"want {req.want} trimmed to {max(room, 0)}: an actor holds at most buffer.max_groups_per_actor="
                     f"{bc.max_groups_per_actor} open groups (it holds {self.buffer.held_by(req.actor_id)})")
        ids = self.buffer.grant(req.actor_id, req.want, req.policy, self._live_identities()) if req.want >= 1 else []
        if error:
            self.counters["grant_requests_out_of_bounds"] += 1
        self.counters["groups_granted"] += len(ids)
        self.counters["grants_refused"] += 0 if ids else 1
        learner = self.buffer.admission.lineage
        self.control.reply(peer, AdmissionGrant(
            actor_id=req.actor_id, group_ids=ids, learner_version=self.buffer.version,
            learner_lineage=learner.id if learner is not None else "", max_staleness=self.buffer.max_staleness,
            retry_after_s=0.0 if ids else bc.grant_retry_s,
            refused="" if ids else self.buffer.admission.judge(req.policy) or "wait",
            error=error, buffer_id=self.incarnation))

    def _batch_request(self, peer: bytes, req: BatchRequest) -> None:
        if not self._try_batch(peer, req):
            # One parked request per learner peer and rank (a newer one means the older was given up on), and at
            # most MAX_PARKED in all: each still gets its one reply.
            older = [x for x in self._parked if x[0] == peer and x[1].rank == req.rank]
            if older or len(self._parked) >= MAX_PARKED:
                if older:
                    self._parked = [x for x in self._parked if x not in older]
                for p, r, _ in older if older else [(peer, req, 0.0)]:
                    self.batches.reply_bundle(p, BatchHeader(batch_id=-1, version=r.version, ready=False), [])
                self.counters["parked_replaced" if older else "parked_refused_full"] += 1
                if not older:
                    return
            timeout = min(max(0.0, float(req.timeout_s)), MAX_PARK_S)
            self._parked.append((peer, req, self.clock() + timeout))

    def _try_batch(self, peer: bytes, req: BatchRequest) -> bool:
        """Reply with this rank's share if the batch exists or can be formed now; False = not yet."""
        try:
            got = self.buffer.take_batch(req.version, req.rank, req.world,
                                         Lineage.parse(req.lineage) if req.lineage else None)
        except ValueError as exc:
            self._warn("bad_batch", "buffer: bad batch request from rank %d: %s", req.rank, exc)
            self.counters["bad_batch_requests"] += 1
            self.batches.reply_bundle(peer, BatchHeader(batch_id=-1, version=req.version, ready=False), [])
            return True
        if got is None:
            return False
        batch_id, groups = got
        header = BatchHeader(batch_id=batch_id, group_sizes=[len(g) for g in groups], version=req.version, ready=True)
        self.batches.reply_bundle(peer, header, [t for g in groups for t in g])
        self.counters["batch_replies"] += 1
        return True

    def _serve_parked(self, now: float) -> None:
        still = []
        for peer, req, deadline in self._parked:
            if self._try_batch(peer, req):
                continue
            if deadline <= now:
                self.batches.reply_bundle(peer, BatchHeader(batch_id=-1, version=req.version, ready=False), [])
                self.counters["batch_not_ready"] += 1
            else:
                still.append((peer, req, deadline))
        self._parked = still

    def _command(self, cmd: ControlCommand) -> ControlCommand:
        try:
            if cmd.command == "set_max_staleness":
                why = self._learner_speaks(cmd)
                if why:
                    self.counters[f"control_refused_{why}"] += 1
                    raise ValueError(f"set_max_staleness needs the learner credential ({why}; "
                                     "async_vla/learner_secret.py): sign it, or write <run>/control/max_staleness")
                if not isinstance(cmd.value, int) or isinstance(cmd.value, bool):
                    raise ValueError(f"set_max_staleness needs an int, got {cmd.value!r}")
                return ControlCommand("ok", self.buffer.set_max_staleness(cmd.value, source="control"))
            if cmd.command == "stats":
                return ControlCommand("stats", json.dumps(self.stats()))
            raise ValueError(f"unknown command {cmd.command[:64]!r}")
        except (TypeError, ValueError, OverflowError) as exc:
            self.counters["control_errors"] += 1
            return ControlCommand("error", str(exc)[:500])

    # ------------------------------------------------------------------ chores
    def _periodic(self, now: float, on_status: Optional[Callable[[dict], None]]) -> None:
        bc, due = self.cfg.buffer, self._due
        if now >= due["expire"]:
            due["expire"] = now + bc.expire_every_s
            n = self.buffer.expire(now)
            self._reclaim_silent(now)
            if n:
                log.warning("buffer: %d trajectories of partial groups expired (group_timeout_s=%s)", n,
                            bc.group_timeout_s)
            if not self.buffer.has_room() and self.buffer.ready_groups < self.buffer.B:
                # Full of partial groups whose other members wait behind the socket: only expiry frees it.
                self.counters["full_without_batch"] += 1
                if self.counters["full_without_batch"] % 60 == 1:
                    log.warning("buffer: %d bytes held but fewer than B=%d groups complete; raise "
                                "buffer.max_bytes or lower pacing (max_staleness)", self.buffer.held_bytes,
                                self.buffer.B)
        if now >= due["file"]:
            due["file"] = now + bc.control_poll_s
            self.check_control_file()
        if now >= due["ledger"]:
            due["ledger"] = now + bc.ledger_every_s
            try:
                self.write_ledger()
            except OSError as exc:   # a full disk must not take the buffer (and what it holds) down
                self.counters["ledger_write_errors"] += 1
                log.error("buffer: writing the ledger failed (%s); retrying in %.0f s", exc, bc.ledger_every_s)
        if now >= due["status"]:
            due["status"] = now + self.cfg.logging.status_every_s
            self.latest_metrics = self.metrics()  # one reference swap: safe to read from other threads
            if on_status is not None:
                on_status(self.latest_metrics)

    def check_control_file(self) -> None:
        """Apply ``<run>/control/max_staleness`` (an int) when the file changes; bad contents are logged."""
        try:
            st = self._eta_file.stat()
        except FileNotFoundError:
            return
        sig = (st.st_mtime_ns, st.st_size)
        if sig == self._eta_file_sig:
            return
        self._eta_file_sig = sig
        try:   # deleted between stat and read, or not text: the file is user input and must not stop the buffer
            with open(self._eta_file, "rb") as f:   # an int is short: never read a huge file whole
                text = f.read(64).decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("buffer: could not read %s (%s); ignored", self._eta_file, exc)
            return
        try:
            self.buffer.set_max_staleness(int(text), source=f"file {self._eta_file}")
        except ValueError as exc:
            self.counters["control_file_refused"] += 1
            log.warning("buffer: %s holds %r: %s; ignored", self._eta_file, text[:40], exc)

    def audit_books(self) -> str:
        """The ledger's structural check, live (GroupBuffer.check_invariants: pending and held bytes recomputed from
        the groups themselves, not from the counters add() keeps): "ok", or what disagreed (logged, counted)."""
        try:
            self.buffer.check_invariants()
        except AssertionError as exc:
            self.counters["invariant_failures"] += 1
            self._warn("invariants", "buffer: the books disagree with the structures: %s", exc)
            return f"FAILED: {exc}"[:500]
        self.counters["invariant_checks"] += 1
        return "ok"

    def write_ledger(self) -> Path:
        """Flush the recording, then write ledger.json (recorded_records = how many records it reflects)."""
        extra = {"service": dict(self.counters),
                 "previous_ledger": self.previous_ledger.name if self.previous_ledger else None,
                 "invariants": self.audit_books(), "incarnation": self.incarnation}
        if self.recorder is not None:
            self.recorder.flush()
            extra["recorded_records"] = self.recorder.records
            extra["recording"] = recording_info(self.recorder.dir)
        return self.buffer.write_ledger(self.run_dir, extra)

    # ------------------------------------------------------------------ metrics
    def actor_metrics(self) -> dict[str, float]:
        """rollout/* and perf/* from the latest ActorStats of each actor heard from within hung_after_s."""
        now = self.clock()
        alive = {a: e for a, e in self._actors.items() if now - e.get("t", -1e18) <= self.cfg.actor.hung_after_s}
        stats = [e["stats"] for e in alive.values() if "stats" in e]
        succ: collections.Counter = collections.Counter()
        eps: collections.Counter = collections.Counter()
        steps_per_s = 0.0
        valid = self.buffer.valid_task_ids
        for s in stats:   # task ids of this run only: forged ones must not grow the metrics (and the stats reply)
            succ.update({k: v for k, v in s.successes_by_task.items() if _task_of_run(k, valid)})
            eps.update({k: v for k, v in s.episodes_by_task.items() if _task_of_run(k, valid)})
            if s.interval_s > 0:
                steps_per_s += s.env_steps / s.interval_s
        m = {"perf/actors_alive": float(len(alive)), "perf/env_steps_per_s": steps_per_s}
        if sum(eps.values()):
            m["rollout/success_rate"] = sum(succ.values()) / sum(eps.values())
            m["rollout/episodes"] = float(sum(eps.values()))   # what that rate is over: the actors' last windows
        for task, n in sorted(eps.items()):
            if n:
                m[f"rollout/success_rate_by_task/{task}"] = succ[task] / n
        return m

    def memory_bound(self, connections: int) -> int:
        """What this process may hold in trajectories: buffer.max_bytes plus, per trajectory connection,
        trajectory_hwm + 1 messages as large as transport.max_message_mb (docs/ARCHITECTURE.md says why; what it
        does not cover: docs/RELIABILITY.md, threats). Code and interpreter come on top."""
        per_connection = (self.cfg.transport.trajectory_hwm + 1) * self.receiver.max_bytes
        return self.cfg.buffer.max_bytes + connections * per_connection

    def metrics(self) -> dict[str, float]:
        """Buffer ledger and pacing, actor throughput and success, service counters, and the process's memory
        against its bound (buffer/rss_bytes, Linux only, and buffer/memory_bound_bytes): one flat dict."""
        m = self.buffer.metrics()
        connections = self.receiver.connections
        m["buffer/trajectory_connections"] = float(connections)
        m["buffer/memory_bound_bytes"] = float(self.memory_bound(connections))
        rss = process_rss_bytes()
        if rss is not None:
            m["buffer/rss_bytes"] = float(rss)
        m.update(self.actor_metrics())
        m["buffer/parked_requests"] = float(len(self._parked))
        m["buffer/control_malformed"] = float(self.control.malformed.total)
        m["buffer/batch_malformed"] = float(self.batches.malformed.total)
        for k, v in self.counters.items():
            m[f"buffer/{k}"] = float(v)
        m.update(phase_scalars(self.phase_tables()))
        return m

    def phase_tables(self) -> dict[str, dict]:
        """Seconds by phase per process kind (``phases.phase_table``): this buffer, the actors (the seconds of
        each actor's latest ActorStats) and the learner ranks (of each rank's latest BatchRequest)."""
        actors = [e["stats"].phases for e in self._actors.values() if "stats" in e and e["stats"].phases]
        out = {"buffer": phase_table([self.phases.seconds()])}
        if actors:
            out["actor"] = phase_table(actors)
        if self._learner_phases:
            out["learner"] = phase_table(self._learner_phases.values())
        return out

    def stats(self) -> dict:
        """Reply of ControlCommand("stats"): the ledger snapshot plus counters, metrics, the phase tables (and, when
        recording, how many records the recording holds so far: replaying that many reproduces the buffer as of this
        reply)."""
        return {**self.buffer.ledger_snapshot(), "service": dict(self.counters), "metrics": self.metrics(),
                "phases": self.phase_tables(),
                "recorded_records": self.recorder.records if self.recorder is not None else None}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Write the final ledger, close the recording and the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain(DRAIN_S)
        self.write_ledger()
        if self.recorder is not None:
            self.recorder.close()
        self._release([self.receiver, self.control, self.batches])

    def _release(self, sockets: list) -> None:
        for sock in sockets:
            sock.close()
        for auth in self._auths:
            auth.stop()
        self._ingest_ctx.term()
        self._delivery_ctx.term()

    def _drain(self, seconds: float) -> int:
        """Take in what is already queued on the trajectory socket (closing it would silently drop it)."""
        n, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.receiver.recv(0)
            self._sync_malformed()
            if msg is None:
                break
            self._on_trajectory(msg)
            n += 1
        self.counters["drained_at_stop"] += n
        return n

    def __enter__(self) -> "BufferService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def process_rss_bytes() -> Optional[int]:
    """This process's resident memory now (Linux ``/proc/self/statm``; None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):   # a metric: an unreadable /proc must not stop the serve loop
        return None


def _task_of_run(key: str, valid) -> bool:
    """Is ``key`` (an ActorStats by-task key) one of the run's task ids? (No set known: any integer id.)"""
    try:
        task = int(key)
    except ValueError:
        return False
    return task in valid if valid is not None else True


def archive_ledger(run_dir: Path) -> Optional[Path]:
    """A restarted buffer starts its books from zero: move the previous incarnation's ledger.json aside to
    ledger-<n>.json (n = 1, 2, ... oldest first) so no count is lost; returns the new name, None if none."""
    current = Path(run_dir) / "ledger.json"
    if not current.is_file():
        return None
    n = 1
    while (Path(run_dir) / f"ledger-{n}.json").exists():
        n += 1
    target = Path(run_dir) / f"ledger-{n}.json"
    current.rename(target)
    log.warning("buffer: previous ledger moved to %s", target.name)
    return target
