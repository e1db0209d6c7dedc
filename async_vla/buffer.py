"""Group-assembling replay buffer: pure logic, no sockets, no threads (the service wraps it; serial mode calls it).

A trajectory's life
    add(traj) -> validated (run id, task id, duplicate, group consistency) -> joins its group (by group_id)
    -> the group completes at G = traj.group_size members -> filters -> staleness -> the ready queue
    -> a learner batch (B groups, FIFO by default, split across learner ranks) -> "trained".

Ledger: every received trajectory is in exactly one state; ``received == sum(ledger.values())`` always.
    trained             in a batch handed to the learner (formed by next_batch; reuse does not count it twice;
                        the batch a killed learner was training returns to pending on its rollback)
    filtered_uniform    its complete group had 0 or G successes (dynamic sampling)
    filtered_difficulty its complete group's success rate was outside the (lo, hi) difficulty mask
    stale               its group's lag (learner version - min behaviour version) exceeded eta, either when the
                        group completed or later, while it waited for a batch (the version moved on)
    expired_partial     its group stayed incomplete for group_timeout_s (an actor died), or it arrived after that
    duplicate           a trajectory id already seen in its group
    malformed           failed validation here (wrong_run, unknown_task, bad_action_token, group_mismatch,
                        group_overfull) or was reported by the receiver via count_malformed(reason) (bad frames
                        never become messages)
    pending             in an incomplete group, or in an admitted group not yet put in a batch
``received`` counts every add() and every count_malformed() call.

Pacing (AReaL's staleness manager, areal/core/staleness_manager.py): a grant of n new group ids is issued only if
    running + n + accepted <= (eta + v_rel + 1) * B
where
    running  = groups started and unfinished: granted ids, plus groups with members, not yet complete or expired;
    accepted = groups that completed, passed the filters and were fresh, counted once for the run (trained ones
               stay counted), minus those later dropped as stale (so a dropped group frees its slot instead of
               shrinking the budget for ever); filtered groups are never counted, so actors get replacements;
    v_rel    = learner version - v_base, v_base = the learner version before the first batch was formed (a
               resumed learner starting at version 57 paces like a fresh one: accepted counts from 0 here);
    B        = groups per batch.
Because the learner consumes B groups per version, accepted - v_rel*B is the admitted backlog, so at most
(eta + 1) * B groups are ever being produced or waiting beyond what the learner has consumed: a group granted
at version v is trained by version v + eta + 1 at the latest, and stale drops are rare. Nothing is granted
while has_room() is False. The version moves one per batch whatever learner.minibatches / steps_per_batch are
(docs/LEARNER.md "Versions"); with reuse > 1 groups are consumed more than once, which only loosens pacing, the
eta check still holds.

Memory: held bytes = every trajectory still referenced (open groups, ready queue, formed batches).
has_room() is False when ready groups >= max_groups or held_bytes + (largest trajectory seen) > max_bytes,
so held_bytes never exceeds max_bytes unless a trajectory larger than any before arrives (or one alone does).

Journal: an optional ``journal(t, msg)`` callback receives every state-changing input (trajectories and
ControlCommand events "j.*") so a recording replays into a fresh buffer with the same ledger (recording.py).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from async_vla.buffer_books import STATES, LedgerReports  # noqa: F401 - STATES is part of this module's API
from async_vla.messages import ControlCommand, Message, Trajectory

log = logging.getLogger(__name__)

MAX_WANT = 1024  # an actor asking for more is hostile or buggy; cap what one grant can take
JOURNAL_COMMANDS = ("j.malformed", "j.version", "j.eta", "j.expire", "j.batch", "j.grant", "j.rollback")


@dataclass(eq=False)
class _Group:
    """One group being assembled or held. ``refs`` counts holders after completion (ready queue, batches)."""

    gid: str
    last_t: float
    size: int = 0                       # G, from the first member (0 = granted, nothing arrived yet)
    members: list = field(default_factory=list)
    traj_ids: set = field(default_factory=set)
    key: Optional[tuple] = None         # (group_size, task_id, init_state_id, run_id) every member must share
    min_bv: int = 2**62                 # oldest behaviour version among members
    nbytes: int = 0
    uses: int = 0
    refs: int = 0
    trained: bool = False


@dataclass(eq=False)
class _Batch:
    batch_id: int
    version: int
    groups: list


class GroupBuffer(LedgerReports):
    """Streaming group assembly, filters, staleness, pacing, batches and the ledger. Not thread-safe."""

    def __init__(self, cfg, run_id: str, clock: Callable[[], float] = time.monotonic,
                 valid_task_ids: Optional[Iterable[int]] = None,
                 journal: Optional[Callable[[float, Message], None]] = None, gid_start: int = 0):
        from async_vla import grpo  # lazy: grpo imports torch, which only the filters' two predicates need here

        self._mixed_outcome, self._difficulty_mask = grpo.mixed_outcome, grpo.difficulty_mask
        self.cfg = cfg.buffer
        self.B = self.cfg.groups_per_batch
        if self.cfg.max_groups < self.B:
            raise ValueError(f"buffer.max_groups ({self.cfg.max_groups}) must be at least buffer.groups_per_batch "
                             f"({self.B}), or a batch can never form")
        self.run_id = run_id
        self.clock = clock
        self.valid_task_ids = None if valid_task_ids is None else frozenset(int(t) for t in valid_task_ids)
        # Action token ids the policy can score (the tokenizer's last num_bins ids); anything else would make the
        # learner's token_logprobs raise on every retry of that batch.
        self.token_range = (cfg.policy.vocab_size - cfg.policy.num_bins, cfg.policy.vocab_size - 1)
        self.journal = journal
        self.max_staleness = self.cfg.max_staleness
        self.version = 0
        self._v_base = 0
        self._open: dict[str, _Group] = {}
        self._ready: collections.deque[_Group] = collections.deque()
        self._batches: dict[int, _Batch] = {}          # by learner version; at most the latest two
        self._closed: collections.OrderedDict[str, tuple[str, frozenset]] = collections.OrderedDict()
        self.received = 0
        self._counts: collections.Counter = collections.Counter()   # terminal states
        self.malformed_by_reason: collections.Counter = collections.Counter()
        self.group_counts: collections.Counter = collections.Counter()  # group-level outcomes
        self.lag_histogram: collections.Counter = collections.Counter()  # lag -> trajectories trained at it
        self._pending = 0
        self.held_bytes = 0
        self._largest = 0
        self.accepted_groups = 0
        self.batches_formed = 0
        self._next_gid = int(gid_start)  # the service starts at ms-since-epoch: a restart never reissues an id
        self.eta_changes: list[dict] = []
        self.grants_refused_behind = 0  # grant requests from actors whose policy lags beyond eta
        self.rollbacks: list[dict] = []  # learner restarts from an older checkpoint (see rollback)

    # ------------------------------------------------------------------ input
    def add(self, traj: Trajectory) -> str:
        """Take one trajectory; returns its ledger state right now (e.g. "pending", "duplicate", "stale")."""
        now = self.clock()
        self._record(now, traj)
        self.received += 1
        reason = self._check(traj)
        if reason:
            return self._malformed(reason)
        g = self._open.get(traj.group_id)
        if g is None:
            closed = self._closed.get(traj.group_id)
            if closed is not None:  # a straggler of a group that already left assembly
                state, ids = closed
                if traj.traj_id in ids:
                    return self._terminal("duplicate", 1)
                if state == "expired_partial":
                    return self._terminal("expired_partial", 1)
                return self._malformed("group_overfull")
            g = self._open[traj.group_id] = _Group(traj.group_id, last_t=now)
        if traj.traj_id in g.traj_ids:
            return self._terminal("duplicate", 1)
        key = (traj.group_size, traj.task_id, traj.init_state_id, traj.run_id)
        if g.key is None:
            g.key, g.size = key, traj.group_size
        elif key != g.key:
            return self._malformed("group_mismatch")
        g.members.append(traj)
        g.traj_ids.add(traj.traj_id)
        g.last_t = now
        g.min_bv = min(g.min_bv, traj.behaviour_version)
        g.nbytes += traj.nbytes
        self.held_bytes += traj.nbytes
        self._largest = max(self._largest, traj.nbytes)
        self._pending += 1
        if len(g.members) == g.size:
            return self._complete(g)
        return "pending"

    def count_malformed(self, reason: str) -> None:
        """A frame the receiver could not decode: it was received, so it enters the ledger as malformed."""
        self._record(self.clock(), ControlCommand("j.malformed", str(reason)))
        self.received += 1
        self._malformed(str(reason))

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

    def _malformed(self, reason: str) -> str:
        self.malformed_by_reason[reason] += 1
        return self._terminal("malformed", 1)

    def _terminal(self, state: str, n: int) -> str:
        self._counts[state] += n
        return state

    # ------------------------------------------------------------------ groups
    def _complete(self, g: _Group) -> str:
        """A group reached G members: filters first (intrinsic), then staleness, else admit it."""
        del self._open[g.gid]
        self._remember(g.gid, "complete", g.traj_ids)
        successes = [bool(t.success) for t in g.members]
        if self.cfg.dynamic_sampling and not self._mixed_outcome(successes, g.size):
            return self._reject(g, "filtered_uniform")
        mask = self.cfg.difficulty_mask
        if mask is not None and not self._difficulty_mask(successes, mask[0], mask[1]):
            return self._reject(g, "filtered_difficulty")
        if self.version - g.min_bv > self.max_staleness:
            return self._reject(g, "stale")
        g.refs = 1
        self._ready.append(g)
        self.accepted_groups += 1
        self.group_counts["accepted"] += 1
        return "pending"

    def _reject(self, g: _Group, state: str) -> str:
        n = len(g.members)
        self._counts[state] += n
        self._pending -= n
        self.held_bytes -= g.nbytes
        self.group_counts[state] += 1
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
            del self._open[g.gid]
            self._remember(g.gid, "expired_partial", g.traj_ids)
            if g.members:
                n += len(g.members)
                self._reject(g, "expired_partial")
            else:  # granted, never started (or its actor died first): frees its pacing slot, no ledger entry
                self.group_counts["expired_empty"] += 1
        return n

    # ------------------------------------------------------------------ pacing
    def pacing_capacity(self) -> int:
        """(eta + v_rel + 1) * B - running - accepted: new groups that may be granted now (may be negative)."""
        v_rel = max(0, self.version - self._v_base)
        return (self.max_staleness + v_rel + 1) * self.B - len(self._open) - self.accepted_groups

    def grant(self, actor_id: int, want: int = 1, actor_version: Optional[int] = None) -> list[str]:
        """New group ids ("<run>-g<n>") the actor may start; [] = not now (pacing, memory full, or the actor's
        policy is already too old: whatever it produced would be dropped as stale, so it must fetch weights
        first — the grant's learner_version tells it so)."""
        want = max(0, min(int(want), MAX_WANT))
        n = min(want, max(0, self.pacing_capacity())) if self.cfg.pacing else want
        if not self.has_room():
            n = 0
        if actor_version is not None and self.version - int(actor_version) > self.max_staleness:
            n = 0
            self.grants_refused_behind += 1
        now = self.clock()
        ids = []
        for _ in range(n):
            gid = f"{self.run_id}-g{self._next_gid}"
            self._next_gid += 1
            ids.append(gid)
        if ids:  # journaled: a late first member of an expired grant must replay as expired_partial too
            self._record(now, ControlCommand("j.grant", ",".join(ids)))
            self._open_granted(ids, now)
        return ids

    def _open_granted(self, ids: list[str], now: float) -> None:
        for gid in ids:
            self._open[gid] = _Group(gid, last_t=now)

    def set_max_staleness(self, eta: int, source: str = "api") -> int:
        """Change eta live (logged, kept in eta_changes and metrics); returns the new value."""
        eta = int(eta)
        if eta < 0:
            raise ValueError(f"max_staleness must be >= 0, got {eta}")
        if eta != self.max_staleness:
            self._record(self.clock(), ControlCommand("j.eta", eta))
            log.info("buffer: max_staleness %d -> %d (from %s, learner version %d)", self.max_staleness, eta,
                     source, self.version)
            self.eta_changes.append({"t": time.time(), "version": self.version, "old": self.max_staleness,
                                     "new": eta, "source": source})
            del self.eta_changes[:-100]
            self.max_staleness = eta
            self._purge_stale()
        return eta

    def set_learner_version(self, v: int) -> None:
        """The learner's current version. Never goes backwards here; only a batch request can (``rollback``)."""
        v = int(v)
        if v <= self.version:
            return
        self._record(self.clock(), ControlCommand("j.version", v))
        self.version = v
        if self.batches_formed == 0:
            self._v_base = v
        self._purge_stale()

    def rollback(self, version: int) -> None:
        """A restarted learner resumed from a checkpoint older than our version: follow it back to ``version``.

        A batch already formed at ``version`` is kept and served again; a batch formed for a later version (only
        the newest one is still held: the one the dead learner was training) goes back to the front of the ready
        queue untrained, so the resumed learner trains it again (with ``buffer.reuse`` > 1 it is only released).
        Batches the dead learner consumed before that are gone: their updates died with it, their trajectories
        stay "trained".
        Staleness is measured from ``version`` again (else everything the resumed policy produces would look too
        old and the learner would starve), and v_base moves back as far, so pacing keeps the credit of the batches
        consumed so far (the replayed versions each consume a batch again).
        """
        v = int(version)
        if v >= self.version:
            return
        self._record(self.clock(), ControlCommand("j.rollback", v))
        log.warning("buffer: learner rolled back from version %d to %d (resumed from a checkpoint)", self.version, v)
        self.rollbacks.append({"t": time.time(), "from": self.version, "to": v})
        del self.rollbacks[:-100]
        self._v_base -= self.version - v
        for bv in sorted((bv for bv in self._batches if bv > v), reverse=True):
            for g in reversed(self._batches.pop(bv).groups):
                if self.cfg.reuse == 1 and g.uses == 1:
                    self._untrain(g, bv)
                else:
                    self._release(g)
        self.version = v

    def _untrain(self, g: _Group, batch_version: int) -> None:
        """Undo _form for a group of a batch whose update was lost: back to the front of the ready queue."""
        n = len(g.members)
        g.trained, g.uses = False, 0
        self._counts["trained"] -= n
        self._pending += n
        self.group_counts["trained"] -= 1
        for t in g.members:
            lag = batch_version - t.behaviour_version
            self.lag_histogram[lag] -= 1
            if not self.lag_histogram[lag]:
                del self.lag_histogram[lag]
        self._ready.appendleft(g)  # the batch's reference moves back to the ready queue

    def _purge_stale(self) -> None:
        """Drop ready groups whose lag now exceeds eta (not trained: "stale"; trained leftovers of reuse: gone)."""
        if not self._ready:
            return
        keep = collections.deque()
        for g in self._ready:
            if self.version - g.min_bv <= self.max_staleness:
                keep.append(g)
                continue
            if not g.trained:
                n = len(g.members)
                self._counts["stale"] += n
                self._pending -= n
                self.accepted_groups -= 1
                self.group_counts["stale"] += 1
            self._release(g)
        self._ready = keep

    # ------------------------------------------------------------------ batches
    def next_batch(self, version: int, rank: int = 0, world: int = 1) -> Optional[list[list[Trajectory]]]:
        """This rank's groups of the batch at learner ``version`` (formed once for all ranks), or None."""
        got = self.take_batch(version, rank, world)
        return None if got is None else got[1]

    def take_batch(self, version: int, rank: int = 0, world: int = 1) -> Optional[tuple[int, list[list[Trajectory]]]]:
        """(batch_id, groups [rank*B/W, (rank+1)*B/W) of the batch for ``version``), or None if not enough yet.

        The first request at a version forms the batch (B fresh groups); the other ranks at that version get
        their share of the same batch, and a repeated request gets the same answer again (idempotent).
        """
        if world < 1 or not 0 <= rank < world or self.B % world:
            raise ValueError(f"rank {rank} / world {world} cannot split {self.B} groups evenly")
        if version < self.version:  # ranks move in lock-step: an older version is a learner resumed from a checkpoint
            self.rollback(version)
        self.set_learner_version(version)
        batch = self._batches.get(version)
        if batch is None:
            batch = self._form(version)
            if batch is None:
                return None
        per = self.B // world
        return batch.batch_id, [g.members for g in batch.groups[rank * per:(rank + 1) * per]]

    def _form(self, version: int) -> Optional[_Batch]:
        self._purge_stale()
        if len(self._ready) < self.B:
            return None
        self._record(self.clock(), ControlCommand("j.batch", int(version)))
        fifo = self.cfg.order == "fifo"
        groups = [self._ready.popleft() if fifo else self._ready.pop() for _ in range(self.B)]
        for g in groups:  # the ready queue's reference moves to the batch
            g.uses += 1
            if not g.trained:
                g.trained = True
                n = len(g.members)
                self._counts["trained"] += n
                self._pending -= n
                self.group_counts["trained"] += 1
            for t in g.members:
                self.lag_histogram[self.version - t.behaviour_version] += 1
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

    def ready_group_ids(self) -> list[str]:
        """Ids of admitted groups waiting for a batch, in queue order (tests, stats)."""
        return [g.gid for g in self._ready]

    @property
    def groups_in_flight(self) -> int:
        """Started and unfinished groups (granted or partially received)."""
        return len(self._open)

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
        elif cmd == "j.version":
            self.set_learner_version(value)
        elif cmd == "j.eta":
            self.set_max_staleness(value, source="replay")
        elif cmd == "j.expire":
            self.expire(self.clock())
        elif cmd == "j.batch":
            self.take_batch(value)
        elif cmd == "j.rollback":
            self.rollback(value)
        elif cmd == "j.grant":
            self._open_granted(value.split(","), self.clock())
        else:
            raise ValueError(f"not a journal command: {cmd!r}")
