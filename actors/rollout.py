"""Group rollouts: G environments stepped in lock-step with one batched policy call per action chunk. An env that
finishes mid-chunk stops at once (its unexecuted steps' tokens keep ``token_mask`` False); each trajectory is
yielded when its episode ends, with the version of every call it consumed (its behaviour version: the oldest).
Weights are swapped only through ``maybe_swap``, between policy calls or between waves of episodes."""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from actors.env_worker import EnvCrashed, SubprocessEnv
from async_vla.image_ops import random_shift
from async_vla.messages import PolicyTag, Trajectory
from async_vla.phases import PhaseClock

log = logging.getLogger(__name__)

SWAP_MODES = ("between_chunks", "between_episodes")


def env_crash_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this simulator died": only the isolated worker's (an in-process env's exception is a bug
    and takes the actor down, which the fleet restarts)."""
    return (EnvCrashed,)


def _is_isolated(env: Any) -> bool:
    return isinstance(env, SubprocessEnv)


@dataclass
class GroupSpec:
    """What to roll out: a group id issued by the buffer, its task and init state, and its size G."""

    group_id: str
    task_id: int
    init_state_id: int
    group_size: int


@dataclass
class RolloutStats:
    """Cumulative counters of rollouts; per-interval figures are ``now.since(copy taken earlier)``."""

    env_steps: int = 0
    policy_calls: int = 0
    episodes: int = 0
    successes: int = 0
    env_crashes: int = 0
    trajectories: int = 0
    groups: int = 0
    swaps: int = 0
    episodes_by_task: collections.Counter = field(default_factory=collections.Counter)
    successes_by_task: collections.Counter = field(default_factory=collections.Counter)

    def copy(self) -> "RolloutStats":
        out = RolloutStats(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        out.episodes_by_task = collections.Counter(self.episodes_by_task)
        out.successes_by_task = collections.Counter(self.successes_by_task)
        return out

    def since(self, earlier: "RolloutStats") -> "RolloutStats":
        """Counters accumulated after ``earlier`` (a copy taken at the start of a stats interval)."""
        out = RolloutStats()
        for f in self.__dataclass_fields__:
            setattr(out, f, getattr(self, f) - getattr(earlier, f))
        return out


class _Episode:
    """Per-env record of one episode: one row per policy call."""

    __slots__ = ("member", "env", "obs", "active", "crashed", "success", "steps", "t_start", "images",
                 "wrist", "proprio", "tokens", "logprobs", "masks", "versions", "lineage")

    def __init__(self, member: int, env: Any, t_start: float):
        self.member, self.env, self.t_start = member, env, t_start
        self.obs = None
        self.active, self.crashed, self.success, self.steps = True, False, False, 0
        self.images: list = []
        self.wrist: list = []
        self.proprio: list = []
        self.tokens: list = []
        self.logprobs: list = []
        self.masks: list = []
        self.versions: list = []
        self.lineage: Optional[str] = None


class GroupRollout:
    """Runs groups of episodes with batched inference; yields ``messages.Trajectory`` as episodes end. ``envs`` are all
    reset to the group's init state (G envs run a group of G in one wave). ``sampled_dims``: action dimensions sampled
    at ``temperature`` (None = all; the others greedy, their ``token_mask`` False). ``policy_tag()`` gives the tag of
    the weights loaded now (its lineage must not change within an episode); ``maybe_swap`` loads newer weights, called
    only between forward passes (``swap``: between_chunks or between_episodes); ``tick`` and ``should_stop`` run
    before every policy call (True abandons the group); ``crash_types``: exceptions meaning a simulator crash;
    ``parallel``: step envs from threads (None: when every env is an isolated worker); ``phases``: the owner's
    PhaseClock (resets and steps -> ``env_step``, policy calls -> ``policy_forward``, packing -> ``trajectory``);
    ``image_shift`` > 0: each call's images (and wrist images) are randomly shifted by up to that many pixels
    (``image_ops.random_shift``, drawing from ``shift_rng``) before the policy sees them, and stored shifted."""

    def __init__(self, policy: Any, envs: Sequence[Any], *, run_id: str, actor_id: int, temperature: float,
                 policy_tag: Callable[[], PolicyTag], swap: str = "between_chunks",
                 maybe_swap: Optional[Callable[[], None]] = None, tick: Optional[Callable[[], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None, generator: Any = None,
                 stats: Optional[RolloutStats] = None,
                 crash_types: Optional[tuple[type[BaseException], ...]] = None,
                 max_steps: Optional[int] = None, parallel: Optional[bool] = None,
                 sampled_dims: Optional[Sequence[int]] = None, phases: Optional[PhaseClock] = None,
                 image_shift: int = 0, shift_rng: Optional[np.random.Generator] = None):
        if swap not in SWAP_MODES:
            raise ValueError(f"actor.swap must be one of {SWAP_MODES}, got {swap!r}")
        if not envs:
            raise ValueError("GroupRollout needs at least one env")
        if image_shift > 0 and shift_rng is None:
            raise ValueError("actor.image_shift > 0 needs shift_rng (a numpy Generator for the offsets)")
        self.policy, self.envs = policy, list(envs)
        self.run_id, self.actor_id, self.temperature = run_id, int(actor_id), float(temperature)
        self.policy_tag, self.swap = policy_tag, swap
        self.maybe_swap = maybe_swap or (lambda: None)
        self.tick = tick or (lambda: None)
        self.should_stop = should_stop or (lambda: False)
        self.generator = generator
        self.stats = stats if stats is not None else RolloutStats()
        self.phases = phases if phases is not None else PhaseClock()
        self.crash_types = env_crash_types() if crash_types is None else crash_types
        self.max_steps_override = max_steps
        self.image_shift, self.shift_rng = int(image_shift), shift_rng
        self._greedy = policy.tokenizer.greedy_positions(sampled_dims)  # bool [tokens per call] or None
        if parallel is None:
            parallel = len(self.envs) > 1 and all(_is_isolated(e) for e in self.envs)
        # Isolated envs step in their own processes: issuing the G calls at once overlaps them (threads wait
        # on pipes, GIL released). In-process numpy envs are faster called one after another.
        self._pool = ThreadPoolExecutor(len(self.envs), thread_name_prefix="env") if parallel else None
        self._tasks: dict[int, tuple[str, int]] = {}
        self.stopped = False
        """True once a group was abandoned because ``should_stop`` said so."""

    # ------------------------------------------------------------------------------------------------
    def run(self, spec: GroupSpec) -> Iterator[Trajectory]:
        """Roll out the G members of ``spec``; yield each trajectory when its episode ends. Crashed episodes are counted
        and dropped; if ``should_stop`` turns True the group is abandoned and ``self.stopped`` is set."""
        members = list(range(spec.group_size))
        instruction, limit = self._task_info(spec.task_id)
        self.stopped = False
        for start in range(0, len(members), len(self.envs)):
            if self.swap == "between_episodes":
                self.maybe_swap()  # the only swap point in this mode: before any episode of the wave starts
            wave = members[start:start + len(self.envs)]
            yield from self._run_wave(spec, wave, instruction, limit)
            if self.stopped:
                return
        self.stats.groups += 1

    def _task_info(self, task_id: int) -> tuple[str, int]:
        """(instruction, step limit) of a task, cached: static facts, and asking a worker that just died
        would turn one simulator crash into a lost group (any live env can answer)."""
        if task_id not in self._tasks:
            for env in self.envs:
                try:
                    self._tasks[task_id] = (env.instruction(task_id),
                                            self.max_steps_override or env.max_steps(task_id))
                    break
                except self.crash_types as exc:  # type: ignore[misc]
                    log.warning("env crashed answering task %d queries: %s", task_id, exc)
            else:
                raise RuntimeError(f"no env could describe task {task_id}")
        return self._tasks[task_id]

    # ------------------------------------------------------------------------------------------------
    def _run_wave(self, spec: GroupSpec, members: list[int], instruction: str, limit: int) -> Iterator[Trajectory]:
        episodes = [_Episode(m, env, time.time()) for m, env in zip(members, self.envs)]
        with self.phases.phase("env_step"):
            reset = self._map(lambda ep: ep.env.reset(spec.task_id, spec.init_state_id), [(ep,) for ep in episodes])
        for ep, (ok, res) in zip(episodes, reset):
            if ok:
                ep.obs = res
            else:
                self._crashed(ep, res)
        while True:
            live = [ep for ep in episodes if ep.active]
            if not live:
                return
            self.tick()
            if self.should_stop():
                self.stopped = True
                return
            if self.swap == "between_chunks":
                self.maybe_swap()
            with self.phases.phase("policy_forward"):
                actions = self._call_policy(live, instruction)
            dof = actions.shape[2]
            # One call per env and chunk: the env sees the whole chunk, so it can skip rendering the steps
            # whose observations nobody reads (LIBERO env.render_at=decision), and a worker costs one pipe
            # round trip per chunk instead of one per step.
            with self.phases.phase("env_step"):
                results = self._map(lambda ep, a: ep.env.step_chunk(a),
                                    [(ep, actions[b, :limit - ep.steps]) for b, ep in enumerate(live)])
            for ep, (ok, res) in zip(live, results):
                if not ok:
                    self._crashed(ep, res)
                    continue
                obs, done, success, n = res
                ep.masks[-1][:n * dof] = True  # tokens of the steps that were executed
                if self._greedy is not None:
                    ep.masks[-1] &= ~self._greedy  # greedy tokens carry no exploration: not trained
                ep.obs, ep.steps = obs, ep.steps + n
                self.stats.env_steps += n
                if done or success or ep.steps >= limit:
                    ep.active, ep.success = False, bool(success)
                    with self.phases.phase("trajectory"):
                        traj = self._finish(spec, ep, instruction)
                    yield traj

    def _map(self, fn: Callable[..., Any], calls: list[tuple]) -> list[tuple[bool, Any]]:
        """Run env calls (concurrently for isolated env workers); a simulator crash is returned as
        ``(False, exc)`` so it costs only that episode. Any other exception propagates (a bug)."""
        def guarded(*args: Any) -> tuple[bool, Any]:
            try:
                return True, fn(*args)
            except self.crash_types as exc:  # type: ignore[misc]
                return False, exc

        if self._pool is None or len(calls) < 2:
            return [guarded(*c) for c in calls]
        return [f.result() for f in [self._pool.submit(guarded, *c) for c in calls]]

    def _crashed(self, ep: _Episode, exc: BaseException) -> None:
        ep.active, ep.crashed = False, True
        self.stats.env_crashes += 1
        log.warning("env crashed (member %d): %s; episode abandoned", ep.member, exc)

    def close(self) -> None:
        """Stop the env-call threads (the envs themselves belong to the caller)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _call_policy(self, live: list[_Episode], instruction: str) -> np.ndarray:
        """One batched forward pass for every live env; records inputs, outputs and the version used."""
        tag = self.policy_tag()  # read right before the forward: the weights this call really uses
        images = np.stack([ep.obs.image for ep in live])
        wrist = [ep.obs.wrist_image for ep in live]
        if self.image_shift:   # augmentation: the policy acts on, and the trajectory keeps, the shifted images
            images = random_shift(images, self.image_shift, self.shift_rng)
            wrist = [None if w is None else random_shift(w[None], self.image_shift, self.shift_rng)[0] for w in wrist]
        proprio = np.stack([np.asarray(ep.obs.proprio, dtype=np.float32) for ep in live])
        tokens, logprobs = self.policy.act(images, proprio, [instruction] * len(live), self.temperature,
                                           generator=self.generator, greedy=self._greedy)
        actions = self.policy.decode_actions(tokens)
        self.stats.policy_calls += 1
        tokens = np.asarray(tokens, dtype=np.int64)
        logprobs = np.asarray(logprobs, dtype=np.float32)
        actions = np.asarray(actions)
        if actions.ndim != 3 or actions.shape[0] != len(live) or tokens.shape[1] != actions.shape[1] * actions.shape[2]:
            raise ValueError(f"policy returned tokens {tokens.shape} / actions {actions.shape} for {len(live)} envs")
        for b, ep in enumerate(live):
            ep.images.append(images[b])
            ep.wrist.append(wrist[b])
            ep.proprio.append(proprio[b])
            ep.tokens.append(tokens[b])
            ep.logprobs.append(logprobs[b])
            ep.masks.append(np.zeros(tokens.shape[1], dtype=bool))
            ep.versions.append(tag.version)
            if ep.lineage not in (None, tag.lineage):
                raise RuntimeError(f"member {ep.member}: the policy's lineage changed within an episode")
            ep.lineage = tag.lineage
        return actions

    def _finish(self, spec: GroupSpec, ep: _Episode, instruction: str) -> Trajectory:
        versions = np.asarray(ep.versions, dtype=np.int64)
        wrist = None
        if all(w is not None for w in ep.wrist):
            wrist = np.stack(ep.wrist).astype(np.uint8, copy=False)
        self.stats.episodes += 1
        self.stats.trajectories += 1
        self.stats.successes += int(ep.success)
        self.stats.episodes_by_task[str(spec.task_id)] += 1
        self.stats.successes_by_task[str(spec.task_id)] += int(ep.success)
        return Trajectory(
            run_id=self.run_id, actor_id=self.actor_id, group_id=spec.group_id,
            # member index makes the id unique within the group whichever actor runs it, and lets the
            # buffer reject a member that was (wrongly) produced twice.
            traj_id=f"{spec.group_id}/m{ep.member}", task_id=int(spec.task_id),
            init_state_id=int(spec.init_state_id), instruction=instruction,
            behaviour_version=int(versions.min()), success=ep.success, reward=1.0 if ep.success else 0.0,
            env_steps=ep.steps, t_start=ep.t_start, t_end=time.time(), group_size=int(spec.group_size),
            chunk_versions=versions, images=np.stack(ep.images).astype(np.uint8, copy=False),
            proprio=np.stack(ep.proprio).astype(np.float32, copy=False),
            action_tokens=np.stack(ep.tokens), behav_logprobs=np.stack(ep.logprobs),
            token_mask=np.stack(ep.masks), wrist_images=wrist, lineage=ep.lineage)
