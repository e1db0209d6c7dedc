"""Load a config: defaults in code -> YAML file -> dotted overrides (OmegaConf), then validate (pydantic). Every
failure is a ``ConfigError`` whose lines name the dotted field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from async_vla.config.schema import Config


class ConfigError(ValueError):
    """A config that cannot be used. The message names each offending dotted field."""


def _lookup(tree: Any, loc: tuple) -> Any:
    for key in loc:
        try:
            tree = tree[key]
        except (KeyError, IndexError, TypeError):
            return "<missing>"
    return tree


def _format_errors(err: ValidationError, raw: dict) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not str(p).startswith("function-after"))
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in loc[:-1]) or "the top level"
            lines.append(f"{dotted}: unknown key (not a field of {parent}; see docs/CONFIG.md for the allowed keys)")
            continue
        value = _lookup(raw, loc)
        msg = e["msg"].removeprefix("Value error, ")
        # A cross-field check sits on a whole section (loc = the section) or the whole config (loc empty): its
        # message names the fields and values itself, and echoing the section would bury it.
        shown = "" if value == "<missing>" or len(loc) <= 1 else f" (got {value!r})"
        lines.append(f"{msg}{shown}" if not loc else f"{dotted}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_overrides(overrides: Iterable[str]) -> dict:
    """Dotted ``a.b=value`` strings to a nested dict (values parsed as YAML scalars by OmegaConf)."""
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form section.field=value (e.g. learner.lr=5e-6)")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(overrides), resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from exc


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> Config:
    """Build and validate a Config. Raises ConfigError before anything is started."""
    layers = [OmegaConf.create(Config().model_dump(mode="json"))]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
        layers.append(OmegaConf.create(data))
    layers.append(OmegaConf.create(parse_overrides(overrides)))
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge config layers: {exc}") from exc
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, merged)) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text (what gets written into the run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def run_dir(cfg: Config) -> Path:
    """``<run.out_dir>/<run.name>``."""
    return Path(cfg.run.out_dir) / cfg.run.name


def write_resolved(cfg: Config, directory: Optional[Path] = None) -> Path:
    """Write ``config.yaml`` (fully resolved) into the run directory and return its path."""
    directory = Path(directory) if directory is not None else run_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "config.yaml"
    out.write_text(dump_config(cfg))
    return out
