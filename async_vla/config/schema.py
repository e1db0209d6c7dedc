"""The root config: one typed tree of sections plus the checks that span sections."""

from __future__ import annotations

import importlib.util

from pydantic import Field, model_validator

from async_vla.config.sections import (
    ActorConfig,
    BufferConfig,
    EnvConfig,
    LearnerConfig,
    LoggingConfig,
    LossConfig,
    PolicyConfig,
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

    @model_validator(mode="after")
    def _cross_section(self) -> "Config":
        # Each message names the dotted fields involved and how to fix them.
        if self.buffer.groups_per_batch % self.learner.num_ranks:
            raise ValueError(
                f"buffer.groups_per_batch ({self.buffer.groups_per_batch}) must be a multiple of "
                f"learner.num_ranks ({self.learner.num_ranks}) so every rank gets the same number of groups"
            )
        t = self.transport
        if not t.use_ipc and not _is_loopback(t.host) and not t.curve:
            raise ValueError(
                f"transport.host={t.host} exposes the buffer beyond this machine: remote actors need "
                f"transport.curve=true and transport.curve_dir (keys from bin/keys DIR)")
        if t.curve and not t.curve_dir:
            raise ValueError("transport.curve=true needs transport.curve_dir (a directory written by bin/keys)")
        if not _is_loopback(t.host):
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
        if self.policy.arch != "tiny" and self.policy.path is None:
            raise ValueError(f"policy.arch={self.policy.arch} needs policy.path (a local checkpoint directory)")
        if self.policy.num_bins > self.policy.vocab_size:
            raise ValueError("policy.num_bins must not exceed policy.vocab_size")
        if self.policy.hidden_size % self.policy.num_heads:
            raise ValueError(
                f"policy.hidden_size ({self.policy.hidden_size}) must be divisible by policy.num_heads "
                f"({self.policy.num_heads})"
            )
        if self.env.image_size % self.policy.patch_size:
            raise ValueError(
                f"env.image_size ({self.env.image_size}) must be a multiple of policy.patch_size "
                f"({self.policy.patch_size})"
            )
        if self.actor.temperature == 0 and self.buffer.dynamic_sampling:
            # Greedy rollouts of one init state are identical (the simulators are deterministic): every group has
            # one outcome, dynamic sampling drops it, and the learner waits forever.
            raise ValueError(
                "actor.temperature=0 samples all G rollouts of a group identically, so no group is ever of mixed "
                "outcome and buffer.dynamic_sampling drops every one (nothing would train; GRPO's advantages would "
                "be 0 anyway): set actor.temperature > 0 (SimpleVLA-RL: 1.6)")
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
        eta = self.max_staleness
        if self.weights.publish_every > eta + 1:
            raise ValueError(
                f"weights.publish_every ({self.weights.publish_every}) > buffer.max_staleness + 1 ({eta + 1}): "
                "actors would hold weights older than any grant allows while the learner waits for their data; "
                f"set weights.publish_every <= {eta + 1} or raise buffer.max_staleness")
        return self

    @property
    def max_staleness(self) -> int:
        """The run's eta: ``buffer.max_staleness``, or 0 under ``run.mode=sync`` (sync mode is defined by zero
        staleness, whatever the buffer section says). What the buffer and the actors start from."""
        return 0 if self.run.mode == "sync" else self.buffer.max_staleness

    @property
    def tokens_per_call(self) -> int:
        """Action tokens produced by one policy call (chunk_size x action_dim; 56 for OpenVLA-OFT)."""
        return self.policy.chunk_size * self.policy.action_dim


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: an interface no other machine can reach."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
