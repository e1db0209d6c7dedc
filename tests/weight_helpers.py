"""Test support for the weight-broadcast tests: a config with short timeouts and a free port, a mixed-dtype model."""

from __future__ import annotations

import torch

from async_vla.config import Config

FAST = {"timeout_s": 5.0, "join_timeout_s": 1.0, "heartbeat_s": 0.2, "bucket_mb": 0.25}


def weights_cfg(base: dict = FAST, **weights) -> Config:
    """Default config, weights_port 0 (a free port), ``weights.*`` set from ``base`` then ``weights``."""
    cfg = Config()
    cfg.transport.weights_port = 0
    for k, v in {**base, **weights}.items():
        setattr(cfg.weights, k, v)
    return cfg


def mixed_model(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes like a small transformer (plus odd cases: 0-d, empty, bool, int)."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(500 * scale, 64, generator=g)}
    for i in range(3):
        out[f"layers.{i}.attn.qkv"] = torch.randn(192, 64 * scale, generator=g)
        out[f"layers.{i}.attn.bias"] = torch.randn(192, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.mlp.up"] = torch.randn(256, 64 * scale, generator=g).to(torch.float16)
        out[f"layers.{i}.norm"] = torch.ones(64)
    out["head.big"] = torch.randn(300 * scale, 300, generator=g)       # > 0.25 MiB cap: its own bucket
    out["temperature"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 3)
    out["mask"] = torch.rand(37, generator=g) > 0.5
    out["steps"] = torch.arange(11, dtype=torch.int64)
    return out
