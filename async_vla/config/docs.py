"""Render docs/CONFIG.md from the config schema, so the knob reference can never drift from the code."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from async_vla.config.schema import Config


def _type_name(annotation: Any) -> str:
    # Generic aliases (Literal[...], Optional[...]) print their arguments only through str().
    text = str(annotation) if getattr(annotation, "__args__", None) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return ""
    return "`" + json.dumps(value) + "`"


def render_config_doc() -> str:
    """Markdown: one table per section with every field, its type, default and docstring."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `async_vla/config/sections.py` by `bin/config-docs` (a test fails if this file is stale).",
        "Layers: defaults in code -> a YAML file (`configs/*.yaml`) -> dotted CLI overrides (`loss.eps_high=0.28`).",
        "Everything is validated at load time; the resolved config is written to `<run.out_dir>/<run.name>/config.yaml`.",
        "",
    ]
    root = Config()
    for section, info in Config.model_fields.items():
        model = getattr(root, section)
        lines += [f"## `{section}` — {info.description}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in type(model).model_fields.items():
            desc = " ".join((field.description or "").split()).replace("|", "\\|")
            typ = _type_name(field.annotation).replace("|", "\\|")
            lines.append(f"| `{section}.{name}` | {typ} | {_default(getattr(model, name))} | {desc} |")
        lines.append("")
    lines += [
        "## Cross-field checks",
        "",
        "- `buffer.groups_per_batch` must be a multiple of `learner.num_ranks` (equal split across ranks).",
        "- `actor.backend=vllm` needs vLLM installed (the `gpu` extra), `policy.arch=openvla` and "
        "`policy.decoding=autoregressive`.",
        "- `policy.arch` other than `tiny` needs `policy.path`.",
        "- `policy.hidden_size` divisible by `policy.num_heads` (and by 4 with `policy.patch_pos=sincos`); "
        "`env.image_size` a multiple of `policy.patch_size`; "
        "`actor.image_shift < env.image_size`.",
        "- `loss.mis_low < loss.mis_high`; `buffer.difficulty_mask` as `0 <= lo < hi <= 1`.",
        "- `run.mode=sync` runs with eta 0 whatever `buffer.max_staleness` says (`Config.max_staleness`).",
        "- `weights.publish_every <= buffer.max_staleness + 1` (0 + 1 in sync mode).",
        "- `run.serial_lag` only with `run.mode=serial`, and `<= buffer.max_staleness`.",
        "- `buffer.max_staleness <= buffer.max_staleness_limit` (the limit also bounds every live change of eta); "
        "`buffer.reclaim_after_s >= max(actor.hung_after_s, 3 x actor.heartbeat_s)`.",
        "- `actor.temperature=0` (greedy) cannot go with `buffer.dynamic_sampling=true`: every group would have one "
        "outcome and be dropped.",
        "- `transport.host` beyond loopback needs `transport.weights_allowed_peers` (the weight store's allow-list) "
        "and `transport.curve=true` (unless `transport.use_ipc`); "
        "`transport.curve=true` needs `transport.curve_dir`.",
        "- Checked by `bin/train` before it starts anything (`runner/preflight.py`): `policy.path` exists and is a "
        "checkpoint of `policy.arch`, `learner.deepspeed_config` is a JSON object, the CURVE keys load, the ports "
        "are free, and a new run (no `--resume`) does not go into a directory that holds a run already (its "
        "`config.yaml`): a second run there would append to that run's ledger and logs, overwrite its summary and "
        "meet its weight exports.",
        "",
    ]
    return "\n".join(lines)
