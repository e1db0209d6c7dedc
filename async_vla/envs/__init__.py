"""Simulators behind one interface (docs/CONTRACTS.md, ``base.Env``): ``make_env(cfg, seed)`` builds the built-in
tabletop family (``builtin``, numpy-rendered, no assets) or LIBERO (``libero``, optional extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from async_vla.config import Config
    from async_vla.envs.base import Env


def make_env(cfg: Config, seed: int) -> Env:
    """Build the env family named by ``cfg.env.kind``; ``seed`` drives any simulator randomness."""
    kind = cfg.env.kind
    if kind == "builtin":
        from async_vla.envs.builtin import TabletopEnv

        return TabletopEnv.from_config(cfg.env, seed=seed)
    if kind == "libero":
        # Imported lazily: LIBERO (MuJoCo, robosuite) is an optional extra.
        from async_vla.envs import libero

        return libero.make_libero_env(cfg, seed)
    raise ValueError(f"env.kind={kind!r} is not one of builtin, libero")
