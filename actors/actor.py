"""One actor: a policy, G simulators, and the loop grant -> group rollout -> stream trajectories.

``SerialActor`` is the socket-free core (serial mode calls it directly); ``Actor`` wraps it with the control protocol
of docs/CONTRACTS.md. Every socket is used on the main thread, driven from ``tick()``, which the rollout calls before
every policy call: a hung simulator also stops the heartbeats, which is how the fleet detects and restarts it.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from actors.rollout import GroupRollout, GroupSpec, RolloutStats
from actors.status import sent_log_path, status_path, write_status
from actors.weight_loading import load_weights
from actors.vllm_weights import StaleWeights
from async_vla.learner_secret import actor_secret, actor_secret_path, actor_token
from async_vla.messages import (
    ROOT, ActorStats, AdmissionGrant, GrantRequest, Heartbeat, Message, PolicyTag, Shutdown, Trajectory, encode,
)
from async_vla.phases import PhaseClock

log = logging.getLogger(__name__)

PolicyFactory = Callable[[Any], Any]
EnvFactory = Callable[[Any, int], Any]
COUNTER_RE = re.compile(r"g(\d+)$")


def stable_hash(*parts: Any) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def default_policy_factory(cfg: Any) -> Any:
    """The initial policy: ``cfg.policy.path`` if set, else a tiny random one (seeded by the run seed); with
    ``actor.backend=vllm`` that policy wrapped around an in-process vLLM engine (actors/vllm_backend.py)."""
    if cfg.actor.backend == "vllm":
        from actors.vllm_backend import build_vllm_policy

        return build_vllm_policy(cfg)
    from async_vla.policy import build_policy

    return build_policy(cfg)


def default_env_factory(cfg: Any, seed: int) -> Any:
    """One env of ``cfg.env.kind``, isolated in a worker process where ``cfg.env.worker`` says so."""
    from actors.env_worker import make_isolated_env

    return make_isolated_env(cfg, seed)


class SerialActor:
    """Policy + envs + group rollouts, without sockets. ``run_one_group(grant)`` rolls out every group of an
    ``AdmissionGrant`` (or one group id); ``iter_group(group_id)`` streams its trajectories. New weights come through
    ``set_weights`` or the ``weights_source`` callback (None or (tag, state)), polled at ``cfg.actor.swap``'s swap
    points; another lineage's wait for the group to end (a group carries one lineage). ``tag``: the policy's at the
    start; ``phases``: the owner's PhaseClock."""

    def __init__(self, cfg: Any, actor_id: int, policy: Any, envs: Sequence[Any], *,
                 tag: PolicyTag = PolicyTag(ROOT, 0),
                 weights_source: Optional[Callable[[], Optional[tuple[PolicyTag, dict]]]] = None,
                 tick: Optional[Callable[[], None]] = None, should_stop: Optional[Callable[[], bool]] = None,
                 phases: Optional[PhaseClock] = None):
        self.cfg, self.actor_id, self.policy, self.envs = cfg, int(actor_id), policy, list(envs)
        self.phases = phases if phases is not None else PhaseClock()
        self.tag = tag
        self._held: Optional[tuple[PolicyTag, dict]] = None   # another lineage's weights, for the next group
        self._in_group = False
        self.weights_source = weights_source
        self.totals = RolloutStats()
        practised = cfg.practised_task_ids
        self.task_ids = list(practised if practised is not None else self.envs[0].task_ids)
        self._train_ids: dict[int, list[int]] = {}
        device = next(policy.parameters()).device if hasattr(policy, "parameters") else torch.device("cpu")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(stable_hash("actor", cfg.run.seed, actor_id) % 2**63)
        self.rollout = GroupRollout(
            policy, self.envs, run_id=cfg.run.name, actor_id=self.actor_id, temperature=cfg.actor.temperature,
            policy_tag=lambda: self.tag, swap=cfg.actor.swap, maybe_swap=self.maybe_swap, tick=tick,
            should_stop=should_stop, generator=self.generator, stats=self.totals, max_steps=cfg.env.max_steps,
            sampled_dims=cfg.actor.sampled_dims, phases=self.phases, image_shift=cfg.actor.image_shift,
            shift_rng=np.random.default_rng(stable_hash("image_shift", cfg.run.seed, actor_id)))

    # ---- weights ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.tag.version

    def set_weights(self, tag: PolicyTag, state: Optional[dict] = None) -> None:
        """Install weights ``state`` (None = the policy object was updated in place) as ``tag``."""
        if state is not None:
            try:
                with self.phases.phase("weights"):
                    load_weights(self.policy, state, tag)
            except StaleWeights as exc:   # the vLLM backend refuses old versions; keep what is installed
                log.warning("actor %d: %s; keeping %s", self.actor_id, exc, self.tag)
                return
        if tag != self.tag:
            self.totals.swaps += 1
            log.info("actor %d: policy %s -> %s", self.actor_id, self.tag, tag)
        self.tag = tag

    def maybe_swap(self) -> None:
        """Swap point: take the newest weights the source has, if they differ from ours (another lineage's only
        between groups: until then they are held)."""
        with self.phases.phase("weights"):
            new = self.weights_source() if self.weights_source is not None else None
        if new is not None and self._in_group and new[0].lineage != self.tag.lineage:
            self._held, new = new, None
        if not self._in_group:
            new, self._held = new or self._held, None
        if new is not None and new[0] != self.tag:
            self.set_weights(*new)

    # ---- group specs --------------------------------------------------------------------------------
    def train_init_states(self, task_id: int) -> list[int]:
        if task_id not in self._train_ids:
            ids = None
            for env in self.envs:  # any live env can answer; a worker that just died must not cost the actor
                try:
                    ids = list(env.init_state_ids(task_id, "train"))
                    break
                except self.rollout.crash_types as exc:  # type: ignore[misc]
                    log.warning("env crashed answering init-state queries: %s", exc)
            if not ids:
                raise ValueError(f"task {task_id} has no train init states")
            self._train_ids[task_id] = self.cfg.practised_init_states(ids)
        return self._train_ids[task_id]

    def spec_for(self, group_id: str) -> GroupSpec:
        """Task and init state of a group: a pure function of (run seed, the counter that ends buffer ids
        ``<run>-<token>-g<n>``), whichever actor runs it; the random token plays no part, so a serial run of a
        seed draws the same scenes every time. Tasks cycle with the counter, so each gets an equal share; ids
        without a counter fall back to a hash of the whole id."""
        m = COUNTER_RE.search(group_id)
        counter = int(m.group(1)) if m else stable_hash("task", group_id)
        task_id = self.task_ids[counter % len(self.task_ids)]
        ids = self.train_init_states(task_id)
        init_state_id = ids[stable_hash("init", self.cfg.run.seed, counter) % len(ids)]
        return GroupSpec(group_id, task_id, init_state_id, self.cfg.actor.group_size)

    # ---- rollouts -----------------------------------------------------------------------------------
    def iter_group(self, group_id: str) -> Iterator[Trajectory]:
        """Stream the trajectories of a group as each episode ends."""
        if self._held is not None:   # a new learner's weights, held back while the last group ran
            held, self._held = self._held, None
            self.set_weights(*held)
        spec = self.spec_for(group_id)
        self._in_group = True
        try:
            yield from self.rollout.run(spec)
        finally:
            self._in_group = False

    def run_one_group(self, grant: Union[AdmissionGrant, str]) -> list[Trajectory]:
        """Every trajectory of the group(s) of a grant (serial mode: no sockets)."""
        group_ids = list(grant.group_ids) if isinstance(grant, AdmissionGrant) else [grant]
        out: list[Trajectory] = []
        for gid in group_ids:
            out.extend(self.iter_group(gid))
        return out

    def close(self) -> None:
        self.rollout.close()
        for env in self.envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a dead simulator must not stop the others from closing
                log.exception("env close failed")


class Actor:
    """An actor process's main loop (see the module docstring). ``run()`` returns the exit code."""

    def __init__(self, cfg: Any, actor_id: int, run_dir: Union[str, Path], endpoints: Optional[dict] = None,
                 policy_factory: Optional[PolicyFactory] = None, env_factory: Optional[EnvFactory] = None, *,
                 stop_event: Optional[threading.Event] = None, parent_pid: Optional[int] = None):
        self.cfg, self.actor_id, self.run_dir = cfg, int(actor_id), Path(run_dir)
        if endpoints is None:
            from async_vla.transport import endpoints as transport_endpoints

            endpoints = transport_endpoints(cfg.transport, self.run_dir, side="connect")
        self.endpoints = endpoints
        self.policy_factory = policy_factory or default_policy_factory
        self.env_factory = env_factory or default_env_factory
        self.stop_event = stop_event or threading.Event()
        self.parent_pid = parent_pid
        self.stop_reason = ""
        self.state = "starting"
        self.learner_version = 0
        self.pending: collections.deque[str] = collections.deque()
        self.phases = PhaseClock()
        """Where this process's time goes (docs/BENCHMARKS.md): sent in every ActorStats."""
        self.groups_granted = 0
        self.send_failures = 0
        self.sent = 0              # trajectories handed to the trajectory socket
        self.sent_by_buffer: collections.Counter = collections.Counter()   # buffer incarnation -> sent
        self._buffer_id = "-"      # the incarnation whose grant we heard last (AdmissionGrant.buffer_id)
        self._sent_log = None      # <run>/actors/sent_<id>.log, line-buffered: a kill -9 loses no complete line
        self.dropped_on_stop = 0   # trajectories abandoned because the actor stopped while the buffer was full
        self.core: Optional[SerialActor] = None
        self._grant_sent_at: Optional[float] = None
        self._retry_at = 0.0
        self._subscriber: Any = None
        self.weights: Any = None       # the WeightSources chain (async_vla.weights.sources), built with the policy
        self._refused = ""             # why the last grant was empty (AdmissionGrant.refused; "" = granted)
        self._asked: Optional[PolicyTag] = None       # the weights our last GrantRequest asked with
        self._next_hb = self._next_stats = 0.0
        self._stats_mark = RolloutStats()
        self._stats_t = time.monotonic()
        self._status_file = status_path(self.run_dir, self.actor_id)
        # Our token under the run's actor secret: the buffer takes no grant request, heartbeat or stats without it
        self._auth = actor_token(actor_secret(actor_secret_path(cfg.transport, self.run_dir)), self.actor_id)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def request_stop(self, reason: str = "stop requested") -> None:
        """Thread/signal-safe: the loop finishes its current policy call, abandons the group and exits."""
        self.stop_reason = self.stop_reason or reason
        self.stop_event.set()

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def run(self) -> int:
        torch.set_num_threads(self.cfg.actor.torch_threads)
        self._connect()
        try:
            self._write_status()  # first sign of life for the fleet (before the slow model/env build)
            with self.phases.phase("startup"):
                self._build()
            self.state = "idle"
            while not self.stopping():
                with self.phases.phase("wait_grant"):
                    group_id = self._next_group()
                if group_id is None:
                    continue
                self.state = "rollout"
                for traj in self.core.iter_group(group_id):
                    with self.phases.phase("send"):
                        self._send(traj)
                self.state = "idle"
            log.info("actor %d stopping: %s", self.actor_id, self.stop_reason)
            return 0
        finally:
            self._shutdown()

    def _connect(self) -> None:
        import zmq

        from async_vla.transport import ControlClient, CurveKeys, TrajectorySender

        keys = CurveKeys.load(self.cfg.transport.curve_dir, "client") if self.cfg.transport.curve else None
        self._ctx = zmq.Context()
        self.sender = TrajectorySender(self.endpoints["trajectory"], hwm=self.cfg.transport.hwm, ctx=self._ctx,
                                       keys=keys)
        # The pid in the identity makes a restarted actor a new peer: a ROUTER ignores a second connection
        # that reuses the identity of one it still thinks is alive.
        self.control = ControlClient(self.endpoints["control"], identity=f"actor-{self.actor_id}-{os.getpid()}".encode(),
                                     ctx=self._ctx, keys=keys)

    def _build(self) -> None:
        """Policy (latest published weights if any, else the initial checkpoint) and the envs."""
        policy = self.policy_factory(self.cfg)
        tag = PolicyTag(ROOT, 0)
        from async_vla.weights import WeightSubscriber
        from async_vla.weights.sources import Broadcast, CatchUp, WeightSources

        self._subscriber = WeightSubscriber(self.cfg, self.actor_id, self.run_dir)
        catch_up = CatchUp(self._subscriber, self._mirror if self.cfg.weights.fetch else None)
        self.weights = WeightSources(Broadcast(self._subscriber), catch_up)
        latest = catch_up.latest()
        if latest is not None:
            tag = latest[0]
            load_weights(policy, latest[1], tag)
        policy.eval()
        n_envs = min(self.cfg.env.envs_per_actor, self.cfg.actor.group_size)
        seeds = [stable_hash("env", self.cfg.run.seed, self.actor_id, j) % 2**31 for j in range(n_envs)]
        # Built concurrently: isolated simulators start in their own processes (LIBERO: 10-30 s each).
        with ThreadPoolExecutor(n_envs) as pool:
            envs = list(pool.map(lambda seed: self.env_factory(self.cfg, seed), seeds))
        self.core = SerialActor(self.cfg, self.actor_id, policy, envs, tag=tag,
                                weights_source=lambda: self.weights.poll(self._tag(), self._refused), tick=self.tick,
                                should_stop=self.stopping, phases=self.phases)
        log.info("actor %d ready: policy %s, %d envs, tasks %s, swap %s", self.actor_id, tag, n_envs,
                 self.core.task_ids, self.cfg.actor.swap)

    def _shutdown(self) -> None:
        self.state = "stopped"
        try:
            if self.core is not None:
                self._send_stats()
            self.control.send(Heartbeat(self.actor_id, os.getpid(), self._tag().version, "stopped", auth=self._auth))
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("final heartbeat failed")
        self._write_status()
        if self._subscriber is not None and hasattr(self._subscriber, "close"):
            self._subscriber.close()
        if self.core is not None:
            self.core.close()
        # Sockets have a short linger: queued trajectories get that long to flush, then close never hangs.
        self.sender.close()
        if self._sent_log is not None:
            self._sent_log.close()
        self.control.close()
        self._ctx.term()

    # ---- weights ------------------------------------------------------------------------------------
    def _tag(self) -> PolicyTag:
        return self.core.tag if self.core is not None else PolicyTag(ROOT, 0)

    def _mirror(self, newer_than: Optional[PolicyTag]) -> None:
        """weights.fetch (no shared run directory): copy the learner's newest export, if newer, from the file server
        on the learner's node into our own <run>/weights, where the subscriber's fetch_latest reads it."""
        from async_vla.transport import CurveKeys
        from async_vla.weights.files import mirror_latest

        t = self.cfg.transport
        keys = CurveKeys.load(t.curve_dir, "client") if t.curve else None
        got = mirror_latest(f"tcp://{t.connect_host}:{t.weights_fetch_port}", self._subscriber.weights_dir,
                            newer_than, keys=keys, timeout_s=self.cfg.actor.grant_timeout_s)
        if got is not None:
            log.info("actor %d: fetched export v%d (lineage %s) from the weights file server", self.actor_id,
                     got.version, got.lineage[:8] or "root")

    # ---- control channel ----------------------------------------------------------------------------
    def _handle(self, msg: Message) -> None:
        if isinstance(msg, AdmissionGrant):
            self._grant_sent_at = None
            self._buffer_id = msg.buffer_id or self._buffer_id
            if msg.error:
                log.warning("actor %d: the buffer answered our grant request with an error: %s", self.actor_id,
                            msg.error)
            self.learner_version = msg.learner_version   # the buffer's view (status only)
            self._refused = msg.refused
            self.pending.extend(msg.group_ids)
            self.groups_granted += len(msg.group_ids)
            if not msg.group_ids:
                self._retry_at = time.monotonic() + min(max(msg.retry_after_s, 0.01), 5.0)
        elif isinstance(msg, Shutdown):
            self.request_stop(f"shutdown from buffer: {msg.reason}")
        else:
            log.debug("ignoring %s on the control channel", type(msg).__name__)

    def _pump(self, timeout_s: float = 0.0) -> None:
        """Handle every control message that is waiting (blocking at most ``timeout_s`` for the first)."""
        msg = self.control.recv(timeout_s)
        while msg is not None:
            self._handle(msg)
            msg = self.control.recv(0.0)

    def tick(self) -> None:
        """Housekeeping between policy calls: control messages, parent check, heartbeat, stats (phase ``control``)."""
        with self.phases.phase("control"):
            self._tick()

    def _tick(self) -> None:
        self._pump(0.0)
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.request_stop("parent fleet process is gone")
        now = time.monotonic()
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.actor.heartbeat_s
            self.control.send(Heartbeat(self.actor_id, os.getpid(), self._tag().version, self.state, auth=self._auth))
            self._write_status()
        if now >= self._next_stats and self.core is not None:
            self._next_stats = now + self.cfg.actor.stats_every_s
            self._send_stats()

    def _next_group(self) -> Optional[str]:
        """A granted group id, or None after waiting a short while (the caller loops)."""
        if self.pending:
            return self.pending.popleft()
        t0 = time.monotonic()
        self.core.maybe_swap()  # no episode is running: any swap mode may take new weights now
        if self._tag() != self._asked:
            # A refusal answers the weights we asked with; new ones (the learner stepped, which is what opens
            # pacing capacity) are a new question: ask now rather than sleep out retry_after_s.
            self._retry_at = t0
        wait = min(0.1, self.cfg.actor.heartbeat_s)
        if t0 >= self._retry_at:
            stale = self._grant_sent_at is not None and t0 - self._grant_sent_at > self.cfg.actor.grant_timeout_s
            if self._grant_sent_at is None or stale:
                if stale:
                    log.warning("actor %d: no grant reply in %.1f s; asking again", self.actor_id,
                                self.cfg.actor.grant_timeout_s)
                # Never blocks: with the control queue full (buffer unreachable) the request is dropped, counted
                # in control.dropped, and asked again on the next pass.
                tag = self._tag()
                if self.control.send(GrantRequest(self.actor_id, 1, tag.version, tag.lineage, auth=self._auth)):
                    self._grant_sent_at, self._asked = t0, tag
                else:
                    self._retry_at = t0 + self.cfg.buffer.grant_retry_s
        else:
            wait = min(wait, self._retry_at - t0)
        self._pump(max(wait, 0.0))
        self.tick()
        return self.pending.popleft() if self.pending else None

    def _send(self, traj: Trajectory) -> None:
        """Stream one trajectory; while the buffer pushes back, keep heartbeating."""
        frames = encode(traj)
        while True:
            if self.sender.send_frames(frames, timeout_s=self.cfg.actor.send_timeout_s):
                self.sent += 1
                self.sent_by_buffer[self._buffer_id] += 1
                if self._sent_log is None:
                    path = sent_log_path(self.run_dir, self.actor_id)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._sent_log = open(path, "a", buffering=1)
                self._sent_log.write(f"{self._buffer_id} {traj.traj_id}\n")
                return
            self.send_failures += 1
            self.tick()
            if self.stopping():
                log.warning("actor %d: dropping trajectory %s (stopping while the buffer is full)",
                            self.actor_id, traj.traj_id)
                self.dropped_on_stop += 1
                return

    # ---- reporting ----------------------------------------------------------------------------------
    def _send_stats(self) -> None:
        now = time.monotonic()
        d = self.core.totals.since(self._stats_mark)
        self.control.send(ActorStats(
            actor_id=self.actor_id, interval_s=now - self._stats_t, env_steps=d.env_steps,
            policy_calls=d.policy_calls, phases=self.phases.seconds(), episodes=d.episodes,
            successes_by_task={k: int(v) for k, v in d.successes_by_task.items()},
            episodes_by_task={k: int(v) for k, v in d.episodes_by_task.items()},
            policy_version=self._tag().version, env_crashes=d.env_crashes, auth=self._auth))
        self._stats_mark, self._stats_t = self.core.totals.copy(), now

    def _write_status(self) -> None:
        t = self.core.totals if self.core is not None else RolloutStats()
        write_status(self._status_file, {
            "actor_id": self.actor_id, "pid": os.getpid(), "t": time.time(), "state": self.state,
            "version": self._tag().version, "learner_version": self.learner_version, "env_steps": t.env_steps,
            "policy_calls": t.policy_calls, "episodes": t.episodes, "successes": t.successes,
            "trajectories": t.trajectories, "groups": t.groups, "env_crashes": t.env_crashes,
            "phases": {name: round(s, 3) for name, s in self.phases.seconds().items()},
            "groups_granted": self.groups_granted, "swaps": t.swaps, "sent": self.sent,
            "weights_from": dict(self.weights.taken) if self.weights is not None else {},
            "sent_by_buffer": dict(self.sent_by_buffer),
            "dropped_on_stop": self.dropped_on_stop,
            "control_dropped": dict(self.control.dropped.by_reason) if hasattr(self, "control") else {}})
