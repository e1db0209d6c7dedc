"""The root config: one typed tree of sections plus the checks that span sections."""

from __future__ import annotations

import importlib.util
from typing import Optional, Sequence

from pydantic import Field, model_validator

from async_vla.envs.limits import BUILTIN_MAX_STEPS, LIBERO_MAX_STEPS
from async_vla.hosts import is_loopback

from async_vla.config.sections import (
    ActorConfig,
    BufferConfig,
    EnvConfig,
    LearnerConfig,
    LoggingConfig,
    LossConfig,
    PlacementConfig,
    PolicyConfig,
    RayConfig,
    RunConfig,
    Section,
    TransportConfig,
    WeightsConfig,
)


class Config(Section):
    """Everything a run needs. Defaults in code -> YAML file -> dotted CLI overrides."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity, mode, stopping and evaluation cadence."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Simulator and init-state splits."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Model architecture, checkpoint and action tokenisation."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Rollout actors."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """Group-assembling replay buffer."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """DeepSpeed learner."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """GRPO objective."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """Weight broadcast to actors."""
    transport: TransportConfig = Field(default_factory=TransportConfig)
    """ZeroMQ sockets."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """TensorBoard and status output."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Which GPU each learner rank, actor and the evaluator use (bin/train)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Placement on a Ray cluster (run.launcher=ray)."""

    @model_validator(mode="after")
    def _cross_section(self) -> "Config":
        # Each message names the dotted fields involved and how to fix them.
        if self.buffer.groups_per_batch % self.learner.num_ranks:
            raise ValueError(
                f"buffer.groups_per_batch ({self.buffer.groups_per_batch}) must be a multiple of "
                f"learner.num_ranks ({self.learner.num_ranks}) so every rank gets the same number of groups"
            )
        per_rank = self.buffer.groups_per_batch // self.learner.num_ranks
        if per_rank % self.learner.minibatches:
            raise ValueError(
                f"learner.minibatches ({self.learner.minibatches}) must divide the groups each learner rank gets "
                f"(buffer.groups_per_batch / learner.num_ranks = {per_rank}): mini-batches are shards of whole "
                f"groups, equal on every rank; set learner.minibatches to a divisor of {per_rank} or raise "
                "buffer.groups_per_batch")
        t = self.transport
        if not t.use_ipc and not is_loopback(t.host) and not t.curve:
            raise ValueError(
                f"transport.host={t.host} exposes the buffer beyond this machine: remote actors need "
                f"transport.curve=true and transport.curve_dir (keys from bin/keys DIR)")
        if t.curve and not t.curve_dir:
            raise ValueError("transport.curve=true needs transport.curve_dir (a directory written by bin/keys)")
        if not is_loopback(t.host):
            if not t.weights_allowed_peers:
                raise ValueError(
                    f"transport.host={t.host} exposes the learner's weight-rendezvous store (no authentication): "
                    "list the actors' addresses or networks in transport.weights_allowed_peers, e.g. [10.0.0.0/24]")
            import ipaddress

            for p in t.weights_allowed_peers:
                try:
                    ipaddress.ip_network(p.strip(), strict=False)
                except ValueError:
                    raise ValueError(f"transport.weights_allowed_peers: {p!r} is not an address or network "
                                     "(e.g. 10.0.0.7 or 10.0.0.0/24)") from None
        if self.actor.backend == "vllm" and self.policy.arch == "openvla_oft":
            # OFT decodes nothing: one bidirectional pass gives all 56 positions, which vLLM's causal paged-KV
            # decoding cannot serve and would not speed up (docs/GPU.md "vLLM and OpenVLA-OFT").
            raise ValueError("actor.backend=vllm serves autoregressive OpenVLA (policy.arch=openvla); OpenVLA-OFT's "
                             "one bidirectional pass runs on actor.backend=torch (docs/GPU.md): set actor.backend=torch")
        if self.actor.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "actor.backend=vllm but vllm is not installed: install the `gpu` extra "
                "(pip install -e '.[gpu]') on a GPU host, or set actor.backend=torch"
            )
        if self.actor.backend == "vllm" and self.policy.decoding != "autoregressive":
            raise ValueError("actor.backend=vllm needs policy.decoding=autoregressive")
        if self.actor.backend == "vllm" and self.policy.arch != "openvla":
            # The tiny arch adds per-position queries and a context vector to its action inputs and has its own
            # action head: not a plain causal LM that vLLM could serve (docs/ARCHITECTURE.md).
            raise ValueError("actor.backend=vllm needs policy.arch=openvla (an autoregressive OpenVLA checkpoint)")
        gl = self.placement.gpus_learner
        # placement is bin/train's on one host; on Ray (and under Slurm) the engine hands out the devices.
        if gl is not None and self.run.launcher == "local" and len(gl) != self.learner.num_ranks:
            raise ValueError(f"placement.gpus_learner {gl} has {len(gl)} GPUs for learner.num_ranks="
                             f"{self.learner.num_ranks}: give one GPU per rank")
        if self.policy.arch != "tiny" and self.policy.path is None:
            raise ValueError(f"policy.arch={self.policy.arch} needs policy.path (a local checkpoint directory)")
        if self.policy.num_bins > self.policy.vocab_size:
            raise ValueError("policy.num_bins must not exceed policy.vocab_size")
        if self.policy.hidden_size % self.policy.num_heads:
            raise ValueError(
                f"policy.hidden_size ({self.policy.hidden_size}) must be divisible by policy.num_heads "
                f"({self.policy.num_heads})"
            )
        if self.policy.patch_pos == "sincos" and self.policy.hidden_size % 4:
            raise ValueError(f"policy.patch_pos=sincos codes rows and columns in quarters of policy.hidden_size "
                             f"({self.policy.hidden_size}): make it a multiple of 4")
        if not self.policy.patch_tokens and not self.policy.keypoints:
            raise ValueError("policy.patch_tokens=false leaves the keypoint tokens as the policy's only view of "
                             "the image, and policy.keypoints is 0: set policy.keypoints > 0 (e.g. 16) or "
                             "policy.patch_tokens=true")
        if self.policy.keypoint_shift and (self.policy.action_head != "fourier_shift" or not self.policy.keypoints):
            raise ValueError("policy.keypoint_shift=true reads the keypoints into the fourier_shift head's shift: set "
                             "policy.action_head=fourier_shift and policy.keypoints > 0, or policy.keypoint_shift=false")
        if self.env.image_size % self.policy.patch_size:
            raise ValueError(
                f"env.image_size ({self.env.image_size}) must be a multiple of policy.patch_size "
                f"({self.policy.patch_size})"
            )
        if self.actor.image_shift >= self.env.image_size:
            raise ValueError(f"actor.image_shift ({self.actor.image_shift}) must be smaller than env.image_size "
                             f"({self.env.image_size}): a shift of a few pixels (DrQ: 4 of 84)")
        dims = self.actor.sampled_dims
        if dims is not None and (not dims or len(set(dims)) != len(dims)
                                 or not all(0 <= d < self.policy.action_dim for d in dims)):
            raise ValueError(f"actor.sampled_dims {dims} must be distinct action dimensions in 0.."
                             f"{self.policy.action_dim - 1} (policy.action_dim={self.policy.action_dim}), at least "
                             "one; or null to sample every dimension")
        if dims is not None and self.actor.backend != "torch":
            raise ValueError("actor.sampled_dims needs actor.backend=torch (vLLM samples every position alike): "
                             "set actor.sampled_dims=null")
        practised = self.actor.task_ids
        if practised is not None and (not practised or len(set(practised)) != len(practised)):
            raise ValueError(f"actor.task_ids {practised} must be distinct task ids, at least one; or null to "
                             "practise every task of env.task_ids")
        if practised is not None and self.env.task_ids is not None and not set(practised) <= set(self.env.task_ids):
            raise ValueError(f"actor.task_ids {practised} must be a subset of env.task_ids {self.env.task_ids} (the "
                             f"tasks the env serves): add {sorted(set(practised) - set(self.env.task_ids))} to "
                             "env.task_ids or drop them from actor.task_ids")
        if (self.actor.num_init_states is not None
                and self.actor.num_init_states > self.env.num_train_init_states):
            raise ValueError(f"actor.num_init_states ({self.actor.num_init_states}) > env.num_train_init_states "
                             f"({self.env.num_train_init_states}): the actors practise train init states only; lower "
                             "actor.num_init_states or raise env.num_train_init_states")
        ids = self.actor.init_state_ids
        if ids is not None and self.actor.num_init_states is not None:
            raise ValueError(f"actor.init_state_ids {ids} and actor.num_init_states ({self.actor.num_init_states}) "
                             "both choose the practised init states: set one of them, the other null")
        if ids is not None and (not ids or len(set(ids)) != len(ids)
                                or not all(0 <= i < self.env.num_train_init_states for i in ids)):
            raise ValueError(f"actor.init_state_ids {ids} must be distinct train init states in 0.."
                             f"{self.env.num_train_init_states - 1} (env.num_train_init_states="
                             f"{self.env.num_train_init_states}), at least one; or null")
        if self.actor.temperature == 0 and self.buffer.dynamic_sampling:
            # Greedy rollouts of one init state are identical (the simulators are deterministic): every group has
            # one outcome, dynamic sampling drops it, and the learner waits forever.
            raise ValueError(
                "actor.temperature=0 samples all G rollouts of a group identically, so no group is ever of mixed "
                "outcome and buffer.dynamic_sampling drops every one (nothing would train; GRPO's advantages would "
                "be 0 anyway): set actor.temperature > 0 (SimpleVLA-RL: 1.6)")
        if self.run.eval_split == "val" and self.env.kind != "builtin":
            raise ValueError(
                f"run.eval_split=val needs the built-in env's validation split (env.kind={self.env.kind} has none): "
                "set run.eval_split=eval")
        if self.run.target_success is not None and (self.env.kind != "builtin" or self.run.eval_split != "eval"):
            raise ValueError(
                f"run.target_success ({self.run.target_success}) stops a run only once a second, independent held-out "
                "set confirms it, which only the built-in env has (its confirm split) and only for "
                "run.eval_split=eval: set run.target_success=null (use the whole budget)")
        if self.run.serial_lag and self.run.mode != "serial":
            raise ValueError(
                f"run.serial_lag ({self.run.serial_lag}) only applies to run.mode=serial (got {self.run.mode!r}): "
                "in async mode lag comes from real concurrency; set run.serial_lag=0 or run.mode=serial")
        if self.run.serial_lag > self.buffer.max_staleness:
            raise ValueError(
                f"run.serial_lag ({self.run.serial_lag}) > buffer.max_staleness ({self.buffer.max_staleness}): every "
                f"group would be dropped as stale; raise buffer.max_staleness or lower run.serial_lag")
        if self.buffer.max_staleness > self.buffer.max_staleness_limit:
            raise ValueError(
                f"buffer.max_staleness ({self.buffer.max_staleness}) > buffer.max_staleness_limit "
                f"({self.buffer.max_staleness_limit}): lower buffer.max_staleness or raise buffer.max_staleness_limit")
        if self.buffer.reclaim_after_s < max(3 * self.actor.heartbeat_s, self.actor.hung_after_s):
            raise ValueError(
                f"buffer.reclaim_after_s ({self.buffer.reclaim_after_s}) < actor.hung_after_s "
                f"({self.actor.hung_after_s}) or 3 x actor.heartbeat_s ({self.actor.heartbeat_s}): an actor the "
                "fleet still counts alive (a slow simulator step) would lose its grants; raise "
                "buffer.reclaim_after_s or lower actor.hung_after_s")
        self._check_batch_fits()
        if self.weights.fetch and self.transport.weights_fetch_port is None:
            raise ValueError("weights.fetch=true needs transport.weights_fetch_port (the buffer's weights file "
                             "server; 0 = a free port picked by the launcher)")
        if self.run.launcher == "ray" and self.run.mode == "serial":
            raise ValueError("run.launcher=ray places the processes of run.mode=async or sync on a Ray cluster: "
                             "run.mode=serial has none (set run.mode=async or run.launcher=local)")
        eta = self.max_staleness
        if self.weights.publish_every > eta + 1:
            raise ValueError(
                f"weights.publish_every ({self.weights.publish_every}) > buffer.max_staleness + 1 ({eta + 1}): "
                "actors would hold weights older than any grant allows while the learner waits for their data; "
                f"set weights.publish_every <= {eta + 1} or raise buffer.max_staleness")
        return self

    def _check_batch_fits(self) -> None:
        """A batch must fit the buffer and a trajectory a message, at the longest episode this env and policy make:
        otherwise the buffer fills with ready groups (or drops every trajectory as oversize) and nothing trains."""
        traj = self.trajectory_bytes
        G, B = self.actor.group_size, self.buffer.groups_per_batch
        batch = B * G * traj
        if self.transport.max_message_mb * 1024**2 < traj:
            raise ValueError(
                f"transport.max_message_mb ({self.transport.max_message_mb:g}) is below one trajectory "
                f"({traj / 1024**2:.1f} MiB: {self.policy_calls_per_episode} policy calls of a {self.env.image_size} px "
                f"image{' + wrist image' if self.env.wrist_camera else ''}): the buffer would drop every trajectory as "
                f"oversize; set transport.max_message_mb >= {_ceil_mib(traj)}")
        if self.buffer.max_bytes < batch:
            raise ValueError(
                f"buffer.max_bytes ({_size(self.buffer.max_bytes)}) cannot hold one batch: "
                f"buffer.groups_per_batch ({B}) x actor.group_size ({G}) x {_size(traj)} per trajectory "
                f"({self.policy_calls_per_episode} policy calls of a {self.env.image_size} px image at the episode limit "
                f"{self.episode_step_limit}) = {_size(batch)}, so the buffer would fill with ready groups "
                f"and never form a batch; set buffer.max_bytes >= {batch} (2-3 batches lets "
                f"actors run ahead), or lower buffer.groups_per_batch, env.image_size or env.max_steps")

    @property
    def practised_task_ids(self) -> Optional[list[int]]:
        """The tasks RL practises: ``actor.task_ids``, else ``env.task_ids`` (None: every task the env has). Of each,
        the actors use the init states ``practised_init_states`` picks."""
        return self.actor.task_ids if self.actor.task_ids is not None else self.env.task_ids

    def practised_init_states(self, train_ids: Sequence[int]) -> list[int]:
        """Of a task's train init states (in order), those RL practises: the ones at ``actor.init_state_ids``,
        else the first ``actor.num_init_states``, else all. The actors and `bin/eval --split practised` both ask
        here."""
        train_ids = list(train_ids)
        if self.actor.init_state_ids is not None:
            return [train_ids[i] for i in self.actor.init_state_ids]
        return train_ids[:self.actor.num_init_states]

    @property
    def episode_step_limit(self) -> int:
        """Env steps of the longest episode: ``env.max_steps``, else the env family's default."""
        if self.env.max_steps is not None:
            return self.env.max_steps
        return LIBERO_MAX_STEPS[self.env.suite] if self.env.kind == "libero" else BUILTIN_MAX_STEPS

    @property
    def policy_calls_per_episode(self) -> int:
        """Policy calls of the longest episode (each executes ``policy.chunk_size`` env steps)."""
        return -(-self.episode_step_limit // self.policy.chunk_size)

    @property
    def trajectory_bytes(self) -> int:
        """Array bytes of the longest trajectory this env and policy produce (``messages.Trajectory.nbytes``): per
        policy call its image(s), proprio, action tokens, log-probs, mask and version."""
        image = self.env.image_size ** 2 * 3 * (2 if self.env.wrist_camera else 1)
        T = self.tokens_per_call
        per_call = image + 4 * self.policy.proprio_dim + T * (8 + 4 + 1) + 8
        return self.policy_calls_per_episode * per_call

    @property
    def max_staleness(self) -> int:
        """The run's eta: ``buffer.max_staleness``, or 0 under ``run.mode=sync`` (sync mode is defined by zero
        staleness, whatever the buffer section says). What the buffer and the actors start from."""
        return 0 if self.run.mode == "sync" else self.buffer.max_staleness

    @property
    def tokens_per_call(self) -> int:
        """Action tokens produced by one policy call (chunk_size x action_dim; 56 for OpenVLA-OFT)."""
        return self.policy.chunk_size * self.policy.action_dim


def _ceil_mib(n: int) -> int:
    return -(-n // 1024**2)


def _size(n: int) -> str:
    """Bytes in the unit that reads best in an error message."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
