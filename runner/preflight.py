"""What `bin/train` checks after the config parsed and before it starts anything: facts the schema cannot know
(files on this host, ports already taken, what ``--resume`` will find), so a run that cannot work fails in a
second with the field and the fix named, instead of a traceback from a child process minutes in."""

from __future__ import annotations

import errno
import json
import re
import socket
from pathlib import Path
from typing import Any, Optional

# The file that marks a checkpoint directory of each policy.arch (async_vla.policy.build.CONFIG_FILE for ours;
# an HF directory's config.json for OpenVLA / OpenVLA-OFT). Read here without importing torch.
POLICY_MARKERS = {"tiny": "async_vla_policy.json", "openvla": "config.json", "openvla_oft": "config.json"}
# NVIDIA's minor version compatibility (docs.nvidia.com/deploy/cuda-compatibility): the oldest Linux driver branch
# that runs anything built with each CUDA major.
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
CUDA12_INDEX = "https://download.pytorch.org/whl/cu128"
DRIVER_FILE = Path("/proc/driver/nvidia/version")


class CannotStart(Exception):
    """A check that needs the launcher's own context (e.g. the Ray cluster's nodes) failed before anything
    started: bin/train prints it as a preflight error ("cannot start:", exit code 2), not as a traceback."""


def preflight(cfg: Any, run_dir: Path, resume: bool) -> tuple[list[str], list[str]]:
    """(errors, warnings) for this config on this host. Errors mean the run cannot start; warnings are printed."""
    errors: list[str] = []
    warnings: list[str] = []
    errors += _policy_path(cfg)
    errors += _deepspeed_json(cfg.learner.deepspeed_config)
    errors += _placement(cfg)
    driver = cuda_driver_problem(*host_cuda())
    if driver is not None:    # torch cannot use this host's GPUs: an error when the config asks for GPUs
        from async_vla.placement import placed

        (errors if placed(cfg) else warnings).append(driver)
    if cfg.transport.curve and cfg.run.mode != "serial":
        errors += _curve_keys(cfg.transport.curve_dir)
    if cfg.policy.path is None and cfg.policy.arch == "tiny" and not resume:
        warnings.append(
            "policy.path is not set: the tiny policy starts from random weights, from which binary-reward RL "
            "rarely finds its first success. Bootstrap it with bin/sft, as bin/quickstart does (it then trains "
            "with policy.path=checkpoints/quickstart_weak_sft).")
    if cfg.run.mode == "serial":   # one process, one learner, one actor: say what the config asks for in vain
        ignored = [f"{k}={v}" for k, v in (("learner.num_ranks", cfg.learner.num_ranks),
                                             ("actor.num_actors", cfg.actor.num_actors)) if v > 1]
        if ignored:
            warnings.append(f"run.mode=serial runs one learner and one actor in this process: {', '.join(ignored)} "
                            "ignored (run.mode=async starts them)")
    run_dir = Path(run_dir)
    if not resume and (run_dir / "config.yaml").is_file():
        # A new run there would append to that run's ledger and logs, overwrite its summary, and meet its weight
        # exports and control files (seen once: the new run's learner and actor hung at the weight broadcast's
        # rendezvous, and the old run's summary was lost).
        held = sorted(p.name for p in run_dir.iterdir())
        errors.append(f"{run_dir} holds a run already ({', '.join(held[:6])}{', ...' if len(held) > 6 else ''}): "
                      "--resume continues it; to start a new run, set another run.name (or --run-dir), or remove "
                      "the directory")
    if resume:
        if not (run_dir / "config.yaml").is_file():
            # Not an error: a job script that always passes --resume (requeued jobs) starts its first run so.
            warnings.append(f"--resume: {run_dir} holds no run yet (no config.yaml): starting a new one. Check "
                            "run.name / --run-dir if you meant to continue another.")
        elif not any((run_dir / "checkpoints").glob("*")):
            warnings.append(f"--resume: no checkpoint in {run_dir / 'checkpoints'} yet: starting at version 0.")
        elif cfg.run.mode != "serial" and cfg.learner.backend == "deepspeed":
            errors += _checkpoint_world(run_dir / "checkpoints", cfg.learner.num_ranks)
    if cfg.run.mode != "serial":
        t = cfg.transport
        errors += busy_ports(t.host, [("transport.trajectory_port", 0 if t.use_ipc else t.trajectory_port),
                                      ("transport.control_port", 0 if t.use_ipc else t.control_port),
                                      ("transport.batch_port", 0 if t.use_ipc else t.batch_port),
                                      ("transport.weights_port", t.weights_port),
                                      ("transport.weights_fetch_port", t.weights_fetch_port or 0)])
    if cfg.logging.serve_tensorboard:
        errors += busy_ports(cfg.logging.tensorboard_host, [("logging.tensorboard_port", cfg.logging.tensorboard_port)])
    return errors, warnings


def host_cuda(driver_file: Path = DRIVER_FILE) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(torch's version, the CUDA version torch was built with, the NVIDIA driver's version) on this host, read from
    torch's ``version.py`` and the driver's /proc entry without importing torch; None for what is absent."""
    import importlib.metadata as md
    import importlib.util

    torch_version = torch_cuda = driver = None
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        version_py = Path(list(spec.submodule_search_locations)[0]) / "version.py"
        text = version_py.read_text() if version_py.is_file() else ""
        found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        torch_cuda = found.group(1) if found else None
        torch_version = md.version("torch")
    if driver_file.is_file():
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", driver_file.read_text())
        driver = found.group(1) if found else None
    return torch_version, torch_cuda, driver


def cuda_driver_problem(torch_version: Optional[str], torch_cuda: Optional[str], driver: Optional[str]) -> Optional[str]:
    """Why torch cannot use this host's NVIDIA GPUs (torch.cuda.is_available() would be False), with the fix; None when
    it can, or when the host has no NVIDIA driver. See docs/GPU.md "Driver"."""
    if driver is None or torch_version is None:
        return None
    if torch_cuda is None:
        return (f"torch {torch_version} is a CPU build on a host with NVIDIA driver {driver}: nothing would run on the "
                "GPUs; install the locked GPU stack: pip install -e '.[gpu]' (README \"GPU install\")")
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    have = int(driver.split(".")[0])
    if need is None or have >= need:
        return None
    pins = "torch==" + torch_version.split("+")[0]
    import importlib.metadata as md

    try:
        pins += " torchvision==" + md.version("torchvision").split("+")[0]
    except md.PackageNotFoundError:
        pass
    fix = f"update the driver to >= {need}"
    if have >= MIN_DRIVER[12]:
        fix += (f", or install PyTorch's CUDA 12 build of the same pins: pip install --force-reinstall {pins} "
                f"--index-url {CUDA12_INDEX} (vLLM's PyPI wheel is a CUDA 13 build: keep actor.backend=torch then)")
    return (f"torch {torch_version} is a CUDA {torch_cuda} build, which needs an NVIDIA driver >= {need}, but this host "
            f"has driver {driver}: torch cannot use its GPUs (torch.cuda.is_available() is False). Fix: {fix} "
            "(docs/GPU.md \"Driver\")")


def _placement(cfg: Any, gpus_dir: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """A placement needs GPUs, as many as its indices name (counted from the driver's /proc entries: no torch)."""
    import os

    from async_vla.placement import VISIBLE, placed

    if cfg.run.mode == "serial":
        return []
    from async_vla.placement import shared_weight_gpu

    shared = shared_weight_gpu(cfg) if cfg.weights.backend == "nccl" else None
    if shared is not None:
        return [f"weights.backend=nccl, but {shared}; NCCL cannot run two ranks on one GPU: give the actors GPUs of "
                "their own (placement.gpus_actors) or set weights.backend=auto (gloo then)"]
    if not placed(cfg):
        return []
    count = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    visible = os.environ.get(VISIBLE)
    if visible is not None and visible.strip():
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    if count == 0:
        return ["the placement section names GPUs but this host has none (no NVIDIA driver entries in "
                f"{gpus_dir}): remove placement.* or run on a GPU host"]
    p = cfg.placement
    used = (p.gpus_learner or []) + (p.gpus_actors or []) + ([p.gpu_evaluator] if p.gpu_evaluator is not None else [])
    if max(used) >= count:
        return [f"placement names GPU {max(used)} but this process sees {count} GPU(s): use indices 0..{count - 1}"]
    return []


def _policy_path(cfg: Any) -> list[str]:
    path = cfg.policy.path
    if path is None:
        return []
    where = Path(path)   # as the loaders will see it (they do not expand ~)
    what = ("a policy saved by bin/sft or a run's policy/ directory" if cfg.policy.arch == "tiny"
            else "a local OpenVLA / OpenVLA-OFT checkpoint directory (its config.json and weights)")
    if not where.is_dir():
        return [f"policy.path: {path} is not a directory on this host; set it to {what}"
                + (", or leave it unset to start from random weights" if cfg.policy.arch == "tiny" else "")]
    marker = POLICY_MARKERS.get(cfg.policy.arch)
    if marker and not (where / marker).is_file():
        return [f"policy.path: {path} has no {marker}, so it is not a policy.arch={cfg.policy.arch} checkpoint; "
                f"set it to {what}"]
    if cfg.policy.arch in ("openvla", "openvla_oft"):   # the flavour the loader would refuse (vla_checkpoint.py)
        from async_vla.vla_checkpoint import checkpoint_problems

        return [f"policy.path: {path} cannot be trained as policy.arch={cfg.policy.arch}: {problem}"
                for problem in checkpoint_problems(where, cfg.policy.arch)]
    return []


def _checkpoint_world(ckpt_dir: Path, num_ranks: int) -> list[str]:
    """A DeepSpeed checkpoint holds one optimizer partition per rank (and one ``rng_rank<r>.pt``, ours): it resumes
    only on as many ranks as saved it (DeepSpeed refuses otherwise, after everything has started)."""
    try:
        tag = (ckpt_dir / "latest").read_text().strip()
    except OSError:
        return []     # no pointer: the learner falls back to the newest complete checkpoint, left to it
    saved = len(list((ckpt_dir / tag).glob("rng_rank*.pt")))
    if saved and saved != num_ranks:
        return [f"learner.num_ranks={num_ranks} but checkpoint {tag} was saved by {saved} rank(s), and ZeRO's "
                f"optimizer partitions are per rank: resume with learner.num_ranks={saved} (or start a new run)"]
    return []


def _deepspeed_json(path: Any) -> list[str]:
    """A user DeepSpeed JSON must be readable here and hold a JSON object (the learner reads it on every rank)."""
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        return [f"learner.deepspeed_config: cannot read {path} ({exc.strerror or exc}); point it at a DeepSpeed "
                "JSON file on this host, or unset it to use the generated config"]
    except ValueError as exc:
        return [f"learner.deepspeed_config: {path} is not valid JSON ({exc}); fix the file, or unset it to use the "
                "generated config"]
    if not isinstance(data, dict):
        return [f"learner.deepspeed_config: {path} holds a JSON {type(data).__name__}, not an object of DeepSpeed "
                "settings"]
    return []


def _curve_keys(directory: Any) -> list[str]:
    """bin/train runs the buffer (server keys) and the actors and learner (client keys) here: all must load."""
    from async_vla.transport import CurveKeys

    if not directory or not Path(directory).is_dir():
        return [f"transport.curve_dir: {directory!r} is not a directory here; make the keys with bin/keys DIR and "
                "set transport.curve_dir=DIR"]
    for role in ("server", "client"):
        try:
            CurveKeys.load(str(directory), role)
        except (OSError, ValueError) as exc:
            return [f"transport.curve_dir: {role} keys do not load from {directory} ({exc}); make them with "
                    f"bin/keys {directory}"]
    return []


def busy_ports(host: str, fields: list[tuple[str, int]]) -> list[str]:
    """An error for each port (0 = pick a free one: never busy) that cannot be bound on ``host`` here."""
    out = []
    for name, port in fields:
        if not port:
            continue
        problem = _bind_problem(host, port)
        if problem == "in use":
            out.append(f"{name}: {host}:{port} is already in use (another run on this host?); set {name} to a "
                       f"free port, or {name}=0 to pick any free one")
        elif problem:
            out.append(f"{name}: cannot listen on {host}:{port} ({problem}); check the host setting beside it")
    return out


def _bind_problem(host: str, port: int) -> str:
    try:   # the family from the host itself: "::1" or an IPv6-only name is as valid as 127.0.0.1
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return exc.strerror or str(exc)
    # SO_REUSEADDR, as the services themselves bind: a port left in TIME_WAIT by a finished run is free to them.
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return ""
