"""Group-assembling replay buffer: pure logic, no sockets, no threads (the service wraps it; serial mode calls it).

Grants group ids, assembles trajectories into groups, filters them, keeps the ready queue and forms batches; the
counts go to a ``Ledger``, pacing and staleness to ``Admission``. The ledger states, the learner's lineage and the
bounds on control input and memory: docs/CONTRACTS.md "The buffer".
"""

from __future__ import annotations

import collections
import logging
import time
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from async_vla.buffer.admission import Admission
from async_vla.buffer.filters import difficulty_mask, mixed_outcome
from async_vla.buffer.ledger import Ledger, write_json_atomic
from async_vla.messages import ControlCommand, Lineage, Message, PolicyTag, Trajectory

log = logging.getLogger(__name__)

MAX_WANT = 1024  # an actor asking for more is hostile or buggy; cap what one grant can take


@dataclass(eq=False)
class _Group:
    """One group being assembled or held. ``refs`` counts holders after completion (ready queue, batches)."""

    gid: str
    last_t: float
    size: int = 0                       # G, from the first member (0 = granted, nothing arrived yet)
    members: list = field(default_factory=list)
    traj_ids: set = field(default_factory=set)
    key: Optional[tuple] = None         # (group_size, task_id, init_state_id, run_id, lineage) members share
    min_bv: int = 2**62                 # oldest behaviour version among members (its lag)
    max_bv: int = -1                    # newest behaviour version among members (never trained at a lag < 0)
    actor: int = -1                     # the actor it was granted to (only its trajectories join)
    nbytes: int = 0
    uses: int = 0
    refs: int = 0
    trained: bool = False

    @property
    def newest_tag(self) -> PolicyTag:
        return PolicyTag(self.key[4], self.max_bv)


@dataclass(eq=False)
class _Batch:
    batch_id: int
    version: int
    groups: list


class GroupBuffer:
    """Streaming group assembly, filters, the ready queue and batches; counts in ``books`` (a ``Ledger``), pacing
    and staleness in ``admission`` (an ``Admission``). Not thread-safe. ``cfg``: the ``buffer`` section;
    ``token_range``: the (first, last) action token id the policy can score; ``max_staleness``: eta at the start
    (default ``cfg.max_staleness``). ``from_config`` derives both from the root config."""

    def __init__(self, cfg, run_id: str, *, token_range: tuple[int, int], max_staleness: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic, valid_task_ids: Optional[Iterable[int]] = None,
                 journal: Optional[Callable[[float, Message], None]] = None, ledger: Optional[Ledger] = None):
        self.cfg = cfg
        self.B = self.cfg.groups_per_batch
        if self.cfg.max_groups < self.B:
            raise ValueError(f"buffer.max_groups ({self.cfg.max_groups}) must be at least buffer.groups_per_batch "
                             f"({self.B}), or a batch can never form")
        self.run_id = run_id
        self.clock = clock
        self.valid_task_ids = None if valid_task_ids is None else frozenset(int(t) for t in valid_task_ids)
        self.token_range = (int(token_range[0]), int(token_range[1]))
        self.journal = journal
        self.admission = Admission(cfg, cfg.max_staleness if max_staleness is None else max_staleness)
        self._open: dict[str, _Group] = {}
        self._ready: collections.deque[_Group] = collections.deque()
        self._batches: dict[int, _Batch] = {}          # by learner version; at most the latest two
        self._closed: collections.OrderedDict[str, tuple[str, frozenset]] = collections.OrderedDict()
        self.books = ledger if ledger is not None else Ledger()
        self.held_bytes = 0
        self._largest = 0
        self.batches_formed = 0
        self._next_gid = 0              # the ids' counter (the actors' task cycle); the random part makes them unique
        self.grants_refused: collections.Counter = collections.Counter()   # behind / dead (judge) / share
        self.grants_capped = 0          # grant requests trimmed to max_groups_per_actor
        self.rollbacks: list[dict] = []  # learner lineages followed after the first (restarts, resumes)
        self._by_actor: dict[int, set[str]] = {}  # actor -> ids of its granted groups still open

    @classmethod
    def from_config(cls, cfg: Any, run_id: str, **kw) -> "GroupBuffer":
        """A buffer for the root config: its ``buffer`` section, the policy's action token ids (the tokenizer's
        last ``num_bins`` ids) and the run's eta (``Config.max_staleness``: 0 in sync mode)."""
        token_range = (cfg.policy.vocab_size - cfg.policy.num_bins, cfg.policy.vocab_size - 1)
        return cls(cfg.buffer, run_id, token_range=token_range, max_staleness=cfg.max_staleness, **kw)

    @property
    def version(self) -> int:
        """The learner's version, as its latest batch request said."""
        return self.admission.version

    @property
    def max_staleness(self) -> int:
        """eta now."""
        return self.admission.eta

    # ------------------------------------------------------------------ the ledger's counts, read here
    @property
    def received(self) -> int:
        """Every add() and count_malformed() call so far."""
        return self.books.received

    @property
    def ledger(self) -> dict[str, int]:
        """Trajectory counts by state (all nine, pending included)."""
        return self.books.counts()

    @property
    def malformed_by_reason(self) -> collections.Counter:
        return self.books.malformed_by_reason

    @property
    def group_counts(self) -> collections.Counter:
        return self.books.group_counts

    @property
    def lag_histogram(self) -> collections.Counter:
        return self.books.lag_histogram

    def lag_stats(self) -> tuple[float, int]:
        return self.books.lag_stats()

    # ------------------------------------------------------------------ input
    def add(self, traj: Trajectory) -> str:
        """Take one trajectory; returns its ledger state right now (e.g. "pending", "duplicate", "stale")."""
        now = self.clock()
        self._record(now, traj)
        self.books.receive(traj)
        reason = self._check(traj)
        if reason:
            return self.books.malformed(reason)
        g = self._open.get(traj.group_id)
        if g is None:
            closed = self._closed.get(traj.group_id)
            if closed is not None:  # a straggler of a group that already left assembly
                state, ids = closed
                if traj.traj_id in ids:
                    return self.books.settle("duplicate")
                if state in ("expired_partial", "ahead"):
                    return self.books.settle(state)
                return self.books.malformed("group_overfull")
            return self.books.malformed("ungranted_group")      # never opens a group: only grants do
        if traj.actor_id != g.actor:
            return self.books.malformed("not_granted_to_actor")
        if traj.traj_id in g.traj_ids:
            return self.books.settle("duplicate")
        key = (traj.group_size, traj.task_id, traj.init_state_id, traj.run_id, traj.lineage)
        if g.key is None:
            g.key, g.size = key, traj.group_size
        elif key != g.key:
            return self.books.malformed("group_mismatch")
        if self.admission.is_dead(traj.tag):
            self.books.settle("ahead")
            self._drop_open(g, "ahead")
            return "ahead"
        g.members.append(traj)
        g.traj_ids.add(traj.traj_id)
        g.last_t = now
        g.min_bv = min(g.min_bv, int(traj.behaviour_version))
        g.max_bv = max(g.max_bv, int(traj.behaviour_version))
        g.nbytes += traj.nbytes
        self.held_bytes += traj.nbytes
        self._largest = max(self._largest, traj.nbytes)
        self.books.join(traj, self.version)
        if len(g.members) == g.size:
            return self._complete(g)
        return "pending"

    def count_malformed(self, reason: str) -> None:
        """A frame the receiver could not decode: it was received, so it enters the ledger as malformed."""
        self._record(self.clock(), ControlCommand("j.malformed", str(reason)))
        self.books.receive(None)
        self.books.malformed(str(reason))

    def _check(self, traj: Trajectory) -> str:
        if self.cfg.check_run_id and traj.run_id != self.run_id:
            return "wrong_run"
        if not self.validate_task(traj.task_id):
            return "unknown_task"
        tokens = traj.action_tokens[traj.token_mask]
        if tokens.min() < self.token_range[0] or tokens.max() > self.token_range[1]:
            return "bad_action_token"
        return ""

    def validate_task(self, task_id: int) -> bool:
        """Hook: is this a task of the run? (No set given = every task id is valid.)"""
        return self.valid_task_ids is None or task_id in self.valid_task_ids

    # ------------------------------------------------------------------ groups
    def _dead(self, g: _Group) -> bool:
        return g.key is not None and self.admission.is_dead(g.newest_tag)

    def _close(self, g: _Group, state: str) -> None:
        """``g`` leaves assembly (complete, expired, reclaimed, ahead): later stragglers are judged by ``state``."""
        del self._open[g.gid]
        self.admission.on_finished()
        held = self._by_actor.get(g.actor)
        if held is not None:
            held.discard(g.gid)
            if not held:
                del self._by_actor[g.actor]
        self._remember(g.gid, state, g.traj_ids)

    def _drop_open(self, g: _Group, state: str) -> int:
        """Close an open group without admitting it; its members (if any) end in ``state``. Returns them."""
        self._close(g, state)
        n = len(g.members)
        if n:
            self._reject(g, state)
        return n

    def _complete(self, g: _Group) -> str:
        """A group reached G members: filters first (intrinsic), then staleness, else admit it."""
        self._close(g, "complete")
        successes = [bool(t.success) for t in g.members]
        if self.cfg.dynamic_sampling and not mixed_outcome(successes, g.size):
            return self._reject(g, "filtered_uniform")
        mask = self.cfg.difficulty_mask
        if mask is not None and not difficulty_mask(successes, mask[0], mask[1]):
            return self._reject(g, "filtered_difficulty")
        if self.admission.is_stale(g.min_bv):
            return self._reject(g, "stale")
        g.refs = 1
        self._ready.append(g)
        self.admission.on_accepted()
        self.books.admit_group(g.members, self.version)
        return "pending"

    def _reject(self, g: _Group, state: str) -> str:
        self.books.drop_group(g.members, state, self.version)
        self.held_bytes -= g.nbytes
        g.members = []
        return state

    def _release(self, g: _Group) -> None:
        g.refs -= 1
        if g.refs == 0:
            self.held_bytes -= g.nbytes

    def _remember(self, gid: str, state: str, traj_ids: set) -> None:
        self._closed[gid] = (state, frozenset(traj_ids))
        while len(self._closed) > self.cfg.remember_closed_groups:
            self._closed.popitem(last=False)

    def expire(self, now: Optional[float] = None) -> int:
        """Expire groups (granted-empty or partial) idle for more than group_timeout_s; returns trajectories."""
        now = self.clock() if now is None else now
        dead = [g for g in self._open.values() if now - g.last_t > self.cfg.group_timeout_s]
        if not dead:
            return 0
        self._record(now, ControlCommand("j.expire", None))
        n = 0
        for g in dead:
            if g.members:
                n += self._drop_open(g, "expired_partial")
            else:  # granted, never started (or its actor died first): frees its pacing slot, no ledger entry
                self._close(g, "expired_partial")
                self.books.expire_empty_group()
        return n

    def reclaim(self, actor_id: int) -> int:
        """Take back every group granted to ``actor_id`` that is still open (the actor stopped heart-beating):
        empty ones free their pacing slot (groups "reclaimed"), partial ones expire now ("expired_partial": their
        other members will not come); a late member is then an expired_partial straggler. Returns groups."""
        gids = sorted(self._by_actor.get(int(actor_id), ()))
        if not gids:
            return 0
        self._record(self.clock(), ControlCommand("j.reclaim", int(actor_id)))
        for gid in gids:
            g = self._open[gid]
            if g.members:
                self._drop_open(g, "expired_partial")
            else:
                self._close(g, "expired_partial")
                self.books.reclaim_group()
        return len(gids)

    def held_by(self, actor_id: int) -> int:
        """Granted groups of ``actor_id`` still open (granted, or partially received)."""
        return len(self._by_actor.get(int(actor_id), ()))

    @property
    def actors_holding_grants(self) -> list[int]:
        return sorted(self._by_actor)

    # ------------------------------------------------------------------ grants
    def grant(self, actor_id: int, want: int = 1, tag: Optional[PolicyTag] = None, identities: int = 1) -> list[str]:
        """New group ids (capabilities: "<run>-<32 random hex digits>-g<n>", never issued twice) the actor may
        start; [] = not now (``Admission.grantable``: pacing, or its
        policy ``tag`` is unusable - whatever it produced would be dropped - ; memory full; or the actor holds
        ``max_groups_per_actor`` open groups already, or its fair share of the budget among ``identities`` live
        actors). A want above what the actor may still hold is trimmed (``grants_capped``); a want < 1 gets
        nothing; ``tag`` None: not judged by weights."""
        actor_id, want = int(actor_id), max(0, min(int(want), MAX_WANT))
        room = max(0, self.cfg.max_groups_per_actor - self.held_by(actor_id))
        if want > room:
            self.grants_capped += 1
        why = self.admission.judge(tag) if tag is not None else ""
        if why:
            self.grants_refused[why] += 1
        held = self.held_by(actor_id)
        n = self.admission.grantable(tag, min(want, room), held, identities) if self.has_room() else 0
        if not why and self.cfg.pacing and 0 < want and self.admission.share(identities, tag) - held < min(want, room):
            self.grants_refused["share"] += 1        # held back by its fair share (others live want theirs)
        now = self.clock()
        ids = [self._new_gid() for _ in range(n)]
        if ids:  # journaled: a late first member of an expired grant must replay as expired_partial too
            self._record(now, ControlCommand("j.grant", f"{actor_id}:" + ",".join(ids)))
            self._open_granted(actor_id, ids, now)
        return ids

    def _new_gid(self) -> str:
        """An id no one can guess and this buffer never issued (a repeat of one remembered is drawn again; 128
        random bits make a repeat of a forgotten one, or one from an earlier buffer of the run, negligible)."""
        while True:
            gid = f"{self.run_id}-{secrets.token_hex(16)}-g{self._next_gid}"
            if gid not in self._open and gid not in self._closed:
                self._next_gid += 1
                return gid

    def _open_granted(self, actor_id: int, ids: list[str], now: float) -> None:
        for gid in ids:
            if gid in self._open:   # only a replayed journal could ask; a grant never overwrites a group
                raise ValueError(f"group {gid} granted twice")
            self._open[gid] = _Group(gid, last_t=now, actor=actor_id)
        self.admission.on_started(len(ids))
        self._by_actor.setdefault(actor_id, set()).update(ids)

    # ------------------------------------------------------------------ the learner
    def set_max_staleness(self, eta: int, source: str = "api") -> int:
        """Change eta live (logged, kept in ``admission.eta_changes`` and metrics); returns the new value."""
        old = self.max_staleness
        if self.admission.set_eta(eta, source):
            self._record(self.clock(), ControlCommand("j.eta", int(eta)))
            log.info("buffer: max_staleness %d -> %d (from %s, learner version %d)", old, int(eta), source,
                     self.version)
            self._purge_stale()
        return self.max_staleness

    def set_learner_version(self, version: int, lineage: Optional[Lineage] = None) -> None:
        """The learner is at ``version``, as ``lineage`` (None: the one followed so far). Within one lineage the
        version only moves forward (an older one: ValueError); a new lineage is followed wherever it starts
        (docs/CONTRACTS.md "The buffer"), a lineage left behind is refused (ValueError)."""
        old, was, heard = self.version, self.admission.lineage, self.admission.heard
        new = self.admission.follow(version, lineage)
        if not new and self.version == old and heard:
            return
        self._record(self.clock(), ControlCommand("j.learner", f"{self.version} {lineage.encode() if new else ''}"
                                                   .rstrip()))
        if new and was is not None:
            log.warning("buffer: following a new learner lineage %s at version %d (was %s at %d)",
                        lineage.id[:12], self.version, was.id[:12], old)
            self.rollbacks.append({"t": time.time(), "from": old, "to": self.version, "lineage": lineage.id})
            del self.rollbacks[:-100]
        if new:
            self._drop_dead()
        self._purge_stale()

    def _drop_dead(self) -> None:
        """A new lineage: batches the learner cannot have trained go back to the ready queue untrained (a batch
        for a later version: its update died; one holding a dead policy), then every group holding a dead policy
        goes ("ahead"), open or ready."""
        v = self.version
        for bv in sorted(self._batches, reverse=True):
            batch = self._batches[bv]
            if bv < v or (bv == v and not any(map(self._dead, batch.groups))):
                continue
            del self._batches[bv]
            for g in reversed(batch.groups):
                if self.cfg.reuse == 1 and g.uses == 1:
                    self._untrain(g, bv)
                else:
                    self._release(g)
        for g in list(self._open.values()):
            if self._dead(g):
                self._drop_open(g, "ahead")
        self._drop_ready(self._dead, "ahead")

    def _untrain(self, g: _Group, batch_version: int) -> None:
        """Undo _form for a group of a batch whose update was lost: back to the front of the ready queue."""
        g.trained, g.uses = False, 0
        self.books.untrain_group(g.members, batch_version, self.version)
        self._ready.appendleft(g)  # the batch's reference moves back to the ready queue

    def _purge_stale(self) -> None:
        """Drop ready groups whose lag now exceeds eta (not trained: "stale"; trained leftovers of reuse: gone)."""
        self._drop_ready(lambda g: self.admission.is_stale(g.min_bv), "stale")

    def _drop_ready(self, drop: Callable[[_Group], bool], reason: str) -> None:
        """Remove the ready groups ``drop`` picks: untrained ones count as ``reason`` in the ledger; trained
        leftovers of reuse just go."""
        if not self._ready:
            return
        keep = collections.deque()
        for g in self._ready:
            if not drop(g):
                keep.append(g)
                continue
            if not g.trained:
                self.books.drop_group(g.members, reason, self.version)
                self.admission.on_dropped()
            self._release(g)
        self._ready = keep

    # ------------------------------------------------------------------ batches
    def next_batch(self, version: int, rank: int = 0, world: int = 1) -> Optional[list[list[Trajectory]]]:
        """This rank's groups of the batch at learner ``version`` (formed once for all ranks), or None."""
        got = self.take_batch(version, rank, world)
        return None if got is None else got[1]

    def take_batch(self, version: int, rank: int = 0, world: int = 1,
                   lineage: Optional[Lineage] = None) -> Optional[tuple[int, list[list[Trajectory]]]]:
        """(batch_id, groups [rank*B/W, (rank+1)*B/W) of the batch for ``version``), or None if not enough yet.

        The request tells the learner's version and lineage (``set_learner_version``). The first request at a
        version forms the batch (B fresh groups); the other ranks at that version get their share of the same
        batch, and a repeated request gets the same answer again (idempotent). ValueError for a request that
        cannot be served: a bad rank / world, or a learner the buffer no longer follows."""
        if world < 1 or not 0 <= rank < world or self.B % world:
            raise ValueError(f"rank {rank} / world {world} cannot split {self.B} groups evenly")
        batch = self._batches.get(version) if lineage is None or lineage == self.admission.lineage else None
        if batch is None:
            self.set_learner_version(version, lineage)
            batch = self._batches.get(version) or self._form(version)
            if batch is None:
                return None
        per = self.B // world
        return batch.batch_id, [g.members for g in batch.groups[rank * per:(rank + 1) * per]]

    def _form(self, version: int) -> Optional[_Batch]:
        self._purge_stale()
        # Never a lag < 0: a group sampled with weights newer than the learner's version (the broadcast outran
        # the learner's batch request) waits for the version to catch up.
        usable = [g for g in self._ready if g.max_bv <= self.version]
        if len(usable) < self.B:
            return None
        self._record(self.clock(), ControlCommand("j.batch", int(version)))
        fifo = self.cfg.order == "fifo"
        groups = usable[:self.B] if fifo else usable[::-1][:self.B]
        taken = set(map(id, groups))
        self._ready = collections.deque(g for g in self._ready if id(g) not in taken)
        for g in groups:  # the ready queue's reference moves to the batch
            g.uses += 1
            self.books.use_group(g.members, self.version, first_use=not g.trained)
            g.trained = True
            if g.uses < self.cfg.reuse:  # back in line for another use, behind (fifo) / under (lifo) fresh ones
                g.refs += 1
                if fifo:
                    self._ready.append(g)
                else:
                    self._ready.appendleft(g)
        batch = _Batch(self.batches_formed, int(version), groups)
        self.batches_formed += 1
        for old in list(self._batches.values()):  # ranks move in lock-step: older batches are done with
            if old.version < version:
                for g in old.groups:
                    self._release(g)
                del self._batches[old.version]
        self._batches[int(version)] = batch
        return batch

    # ------------------------------------------------------------------ memory
    def has_room(self) -> bool:
        """May the service read another trajectory from its socket? (False = let ZeroMQ push back.)"""
        if len(self._ready) >= self.cfg.max_groups:
            return False
        return self.held_bytes == 0 or self.held_bytes + self._largest <= self.cfg.max_bytes

    @property
    def ready_groups(self) -> int:
        """Admitted groups waiting for a batch (including reuse leftovers)."""
        return len(self._ready)

    @property
    def groups_in_flight(self) -> int:
        """Started and unfinished groups (granted or partially received)."""
        return len(self._open)

    def in_flight(self) -> dict[str, str]:
        """traj_id -> where, for every received trajectory not yet in a terminal state ("assembling", "ready"),
        and those of the batch the learner is training right now ("batch v<version>": its step is not done)."""
        out = {t.traj_id: "assembling" for g in self._open.values() for t in g.members}
        out.update({t.traj_id: "ready" for g in self._ready if not g.trained for t in g.members})
        if self.version in self._batches:
            out.update({t.traj_id: f"batch v{self.version}" for g in self._batches[self.version].groups
                        for t in g.members})
        return out

    # ------------------------------------------------------------------ reports
    def check_invariants(self) -> None:
        """Recompute pending and held bytes from the structures; AssertionError if the books disagree."""
        pending = sum(len(g.members) for g in self._open.values())
        pending += sum(len(g.members) for g in self._ready if not g.trained)
        held = {id(g): g for g in self._open.values()}
        held.update((id(g), g) for g in self._ready)
        held.update((id(g), g) for b in self._batches.values() for g in b.groups)
        held_bytes = sum(g.nbytes for g in held.values())
        assert pending == self.books.pending, (pending, self.books.pending)
        assert held_bytes == self.held_bytes, (held_bytes, self.held_bytes)
        assert self.received == sum(self.ledger.values()), (self.received, self.ledger)
        assert self.admission.running == len(self._open), (self.admission.running, len(self._open))

    def metrics(self) -> dict[str, float]:
        """Scalars for TensorBoard under buffer/*."""
        lag_mean, lag_max = self.lag_stats()
        m = {f"buffer/{s}": float(v) for s, v in self.ledger.items()}
        m.update({
            "buffer/received": float(self.received), "buffer/lag_mean": lag_mean, "buffer/lag_max": float(lag_max),
            "buffer/groups_in_flight": float(len(self._open)), "buffer/held_bytes": float(self.held_bytes),
            "buffer/max_staleness": float(self.max_staleness), "buffer/groups_ready": float(len(self._ready)),
            "buffer/groups_accepted": float(self.admission.accepted), "buffer/batches": float(self.batches_formed),
            "buffer/pacing_capacity": float(self.admission.capacity()), "buffer/learner_version": float(self.version),
            "buffer/grants_refused_behind": float(self.grants_refused["behind"]),
            "buffer/grants_refused_dead": float(self.grants_refused["dead"]),
            "buffer/grants_refused_share": float(self.grants_refused["share"]),
            "buffer/grants_capped": float(self.grants_capped),
        })
        return m

    def ledger_snapshot(self) -> dict:
        """Everything about the books, JSON-able (ledger.json)."""
        return {
            "run_id": self.run_id, **self.books.snapshot(), "learner_version": self.version,
            "learner_lineage": self.admission.lineage.encode() if self.admission.lineage else None,
            "max_staleness": self.max_staleness, "eta_changes": list(self.admission.eta_changes),
            "batches_formed": self.batches_formed, "rollbacks": list(self.rollbacks),
            "grants_refused_behind": self.grants_refused["behind"],
            "grants_refused_dead": self.grants_refused["dead"], "grants_refused_share": self.grants_refused["share"],
            "grants_capped": self.grants_capped,
            "groups_in_flight": len(self._open),
            "actors_holding_grants": len(self._by_actor),
            "most_groups_held_by_one_actor": max(map(len, self._by_actor.values()), default=0),
            "groups_ready": len(self._ready), "held_bytes": self.held_bytes,
        }

    def write_ledger(self, run_dir, extra: Optional[dict] = None) -> Path:
        """Write ``<run_dir>/ledger.json`` atomically (a reader never sees half a file)."""
        return write_json_atomic(Path(run_dir) / "ledger.json", {**self.ledger_snapshot(), **(extra or {})})

    def _record(self, t: float, msg: Message) -> None:
        if self.journal is not None:
            self.journal(t, msg)

    def apply_journal(self, msg: Message) -> None:
        """Replay one journaled input (the clock must already read the recorded time)."""
        if isinstance(msg, Trajectory):
            self.add(msg)
            return
        cmd, value = msg.command, msg.value
        if cmd == "j.malformed":
            self.count_malformed(value)
        elif cmd == "j.learner":   # "<version>[ <encoded lineage>]": a new lineage, else the version moved
            version, _, lineage = value.partition(" ")
            self.set_learner_version(int(version), Lineage.parse(lineage) if lineage else None)
        elif cmd == "j.eta":
            self.set_max_staleness(value, source="replay")
        elif cmd == "j.expire":
            self.expire(self.clock())
        elif cmd == "j.batch":
            self.take_batch(value)
        elif cmd == "j.grant":   # "<actor>:<id>,<id>..."
            actor, _, ids = value.rpartition(":")
            self._open_granted(int(actor), ids.split(","), self.clock())
        elif cmd == "j.reclaim":
            self.reclaim(value)
        else:
            raise ValueError(f"not a journal command: {cmd!r}")
