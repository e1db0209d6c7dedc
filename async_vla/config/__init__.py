"""Config system: typed sections, YAML files, dotted overrides. See docs/CONFIG.md."""

from async_vla.config.loader import ConfigError, dump_config, load_config, parse_overrides, run_dir, write_resolved
from async_vla.config.schema import Config
from async_vla.config.sections import (
    ActorConfig,
    BufferConfig,
    EnvConfig,
    LearnerConfig,
    LoggingConfig,
    LossConfig,
    PolicyConfig,
    RunConfig,
    TransportConfig,
    WeightsConfig,
)

__all__ = [
    "ActorConfig", "BufferConfig", "Config", "ConfigError", "EnvConfig", "LearnerConfig", "LoggingConfig",
    "LossConfig", "PolicyConfig", "RunConfig", "TransportConfig", "WeightsConfig", "dump_config", "load_config",
    "parse_overrides", "run_dir", "write_resolved",
]
