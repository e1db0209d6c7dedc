"""Test support for the weight-broadcast tests: a config with short timeouts and a free port."""

from __future__ import annotations

from async_vla.config import Config

FAST = {"timeout_s": 5.0, "join_timeout_s": 1.0, "heartbeat_s": 0.2, "bucket_mb": 0.25}


def weights_cfg(base: dict = FAST, **weights) -> Config:
    """Default config, weights_port 0 (a free port), ``weights.*`` set from ``base`` then ``weights``."""
    cfg = Config()
    cfg.transport.weights_port = 0
    for k, v in {**base, **weights}.items():
        setattr(cfg.weights, k, v)
    return cfg
