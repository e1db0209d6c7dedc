"""What an OpenVLA / OpenVLA-OFT checkpoint directory is, read from its files without importing torch or its remote
code, and whether async_vla can run and train it here: the remote code's forward contract (``oft_logits``,
``oft_labels``, ``autoregressive``), continuous action heads, proprio, FiLM, unmerged LoRA adapters. bin/train's
preflight and the loader both call ``checkpoint_problems``; the flavours and fixes: docs/FIDELITY.md "Checkpoint
flavours"."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

FORWARDS = {"openvla_oft": ("oft_logits", "oft_labels"), "openvla": ("autoregressive",)}
AUTO_MODEL_KEYS = ("AutoModelForVision2Seq", "AutoModelForImageTextToText")
SIMPLEVLA_RL_FIX = ("copy SimpleVLA-RL's verl/utils/vla_utils/openvla_oft/{configuration,modeling,processing}_prismatic"
                    ".py, constants.py and train_utils.py into the directory (its examples/overwrite_vla_ckpt_utils.sh) "
                    "and set config.json's auto_map AutoModelForVision2Seq to "
                    "modeling_prismatic.OpenVLAForActionPrediction (what its fsdp_workers.py update_auto_map does)")
DISCRETE_FIX = ("use a discrete-token OpenVLA-OFT checkpoint: SimpleVLA-RL's SFT checkpoints (docs/FIDELITY.md), or "
                "fine-tune with openvla-oft's vla-scripts/finetune.py --use_l1_regression False --use_diffusion False "
                "--use_proprio False --use_film False --num_images_in_input 1")
PRISMATIC_TIMM_VERSIONS = ("0.9.10", "0.9.11", "0.9.12", "0.9.16")   # modeling_prismatic.py refuses any other
GPU_EXTRA_HINT = "install the locked GPU stack: pip install -e '.[gpu]' (README \"GPU install\")"
# Missing top-level imports of the remote code and what provides them (anything else: "install it").
PROVIDERS = {"prismatic": "moojink/openvla-oft's package (git clone https://github.com/moojink/openvla-oft && pip "
                          "install --no-deps -e openvla-oft, plus the modules its prismatic/__init__ imports); or "
                          + SIMPLEVLA_RL_FIX + ", whose remote code needs no package"}


@dataclass(frozen=True)
class CheckpointFlavour:
    """What ``read_flavour`` finds in a checkpoint directory."""
    forward: Optional[str]          # oft_logits / oft_labels / autoregressive; None: no remote code found
    modeling_file: Optional[str]    # the remote code file config.json's auto_map names
    action_head: Optional[str]      # None (discrete action tokens), "l1_regression" or "diffusion"
    proprio: bool
    film: bool
    lora_adapter_only: bool


def _component(directory: Path, name: str) -> bool:
    """A component openvla-oft's finetune.py saves beside the weights: ``<name>--<step|latest>_checkpoint.pt``."""
    return any(directory.glob(f"{name}--*checkpoint.pt"))


def _auto_model(config: dict) -> Optional[tuple[str, str]]:
    """(module file, class) of the model class config.json's auto_map names, or None."""
    auto_map = config.get("auto_map") or {}
    ref = next((auto_map[k] for k in AUTO_MODEL_KEYS if k in auto_map), None)
    if not isinstance(ref, str) or "." not in ref:
        return None
    module, cls = ref.split("--")[-1].rsplit(".", 1)
    return module + ".py", cls


def _forward_contract(source: str, cls: str) -> Optional[str]:
    """The forward contract of class ``cls`` in a modeling file (its own methods, then its in-file bases')."""
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    methods: dict[str, ast.FunctionDef] = {}
    todo, seen = [cls], set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        for node in classes[name].body:
            if isinstance(node, ast.FunctionDef):
                methods.setdefault(node.name, node)       # a subclass's method wins over its bases'
        todo += [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
    forward = methods.get("forward")
    if forward is None:
        return None
    args = {a.arg for a in forward.args.args + forward.args.kwonlyargs}
    if "labels" not in args:
        return "oft_logits"
    return "oft_labels" if "_prepare_labels_for_action_prediction" in methods else "autoregressive"


def read_flavour(directory: Union[str, Path]) -> CheckpointFlavour:
    """The flavour of the checkpoint in ``directory`` (its config.json must exist)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    forward = modeling = None
    target = _auto_model(config)
    if target is not None and (directory / target[0]).is_file():
        modeling = target[0]
        forward = _forward_contract((directory / modeling).read_text(errors="replace"), target[1])
    head = None
    if _component(directory, "action_head"):
        head = "diffusion" if _component(directory, "noisy_action_projector") else "l1_regression"
    weights = any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))
    return CheckpointFlavour(forward=forward, modeling_file=modeling, action_head=head,
                             proprio=_component(directory, "proprio_projector") or bool(config.get("use_proprio")),
                             film=_component(directory, "vision_backbone"),
                             lora_adapter_only=(directory / "lora_adapter").is_dir() and not weights)


def flavour_problems(flavour: CheckpointFlavour, arch: str) -> list[str]:
    """Why async_vla cannot train a checkpoint of this flavour as ``policy.arch=arch``, each with its fix."""
    out = []
    if flavour.lora_adapter_only:
        out.append("it holds a LoRA adapter (lora_adapter/) but no merged weights: merge them first (openvla-oft's "
                   "vla-scripts/merge_lora_weights_and_save.py)")
    if flavour.action_head is not None:
        out.append(f"it predicts actions with openvla-oft's continuous {flavour.action_head.replace('_', '-')} action "
                   "head (action_head--*checkpoint.pt), so it has no action-token distribution for GRPO to sample and "
                   f"train (token log-probs): {DISCRETE_FIX}")
    if flavour.proprio:
        out.append("it was trained with proprioception (proprio_projector--*checkpoint.pt or use_proprio in "
                   "config.json), which async_vla does not feed an OpenVLA(-OFT) policy (SimpleVLA-RL's LIBERO recipe "
                   f"runs use_proprio=False): {DISCRETE_FIX}")
    if flavour.film:
        out.append("it uses FiLM (vision_backbone--*checkpoint.pt: openvla-oft's FiLM-wrapped vision backbone), which "
                   f"neither async_vla nor SimpleVLA-RL's forward runs: {DISCRETE_FIX}")
    if flavour.forward is None:
        what = (f"{flavour.modeling_file} has no forward" if flavour.modeling_file else
                "config.json's auto_map names no model class in a .py file of the directory")
        out.append(f"no remote code to run it ({what}): {SIMPLEVLA_RL_FIX}")
    elif flavour.forward not in FORWARDS[arch]:
        other = next(a for a, forwards in FORWARDS.items() if flavour.forward in forwards)
        kind, fix = (("an OpenVLA-OFT", "policy.chunk_size=8 policy.decoding=parallel") if other == "openvla_oft" else
                     ("the autoregressive OpenVLA", "policy.chunk_size=1 policy.decoding=autoregressive"))
        out.append(f"its remote code ({flavour.modeling_file}) has {kind} forward, not policy.arch={arch}'s: set "
                   f"policy.arch={other} {fix}")
    return out


def remote_code_problems(directory: Union[str, Path]) -> list[str]:
    """What the checkpoint's remote code would refuse or fail on in this venv: timm outside the versions it accepts,
    transformers 5, top-level imports that are not installed (imports inside ``try`` are optional)."""
    import importlib.metadata as md

    directory = Path(directory)
    files = sorted(directory.glob("*.py"))
    local = {p.stem for p in files}
    imported: set[str] = set()
    sources = []
    for path in files:
        source = path.read_text(errors="replace")
        sources.append(source)
        tree = ast.parse(source)
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    problems = []
    if "timm" in imported:
        try:
            timm_version: Optional[str] = md.version("timm")
        except md.PackageNotFoundError:
            timm_version = None
        if timm_version not in PRISMATIC_TIMM_VERSIONS:
            problems.append(f"timm {timm_version or 'not installed'} (its remote code accepts only "
                            f"{', '.join(PRISMATIC_TIMM_VERSIONS)}): {GPU_EXTRA_HINT}")
    if any(re.search(r"from transformers\.tokenization_utils import", s) for s in sources):
        tf_version = md.version("transformers")
        if int(tf_version.split(".")[0]) >= 5:
            problems.append(f"transformers {tf_version} (its processor imports transformers.tokenization_utils names "
                            f"that transformers 5 removed; it needs 4.x): {GPU_EXTRA_HINT}")
    for name in sorted(imported - local - {"timm", "__future__"}):
        if importlib.util.find_spec(name) is None:
            problems.append(f"its remote code imports {name}, which is not installed here: install "
                            + PROVIDERS.get(name, f"{name} into this venv"))
    return problems


def checkpoint_problems(directory: Union[str, Path], arch: str) -> list[str]:
    """Every reason the OpenVLA(-OFT) checkpoint in ``directory`` cannot be trained here as ``policy.arch=arch``."""
    return flavour_problems(read_flavour(directory), arch) + remote_code_problems(directory)


def require_trainable(directory: Union[str, Path], arch: str) -> CheckpointFlavour:
    """The checkpoint's flavour, or a ValueError naming every problem and its fix."""
    problems = checkpoint_problems(directory, arch)
    if problems:
        raise ValueError(f"policy.path={directory} cannot be trained as policy.arch={arch}: " + "; ".join(problems))
    return read_flavour(directory)
