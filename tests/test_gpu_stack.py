"""The locked GPU stack (pyproject's `gpu` extra, README "GPU install"): it resolves as one set with pip's own
resolver (a dry run against PyPI; skipped, loudly, when PyPI cannot be reached) and our version guards agree with
its pins. Nothing is installed: the CUDA stack never enters this machine's venv."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from actors.vllm_backend import VLLM_VERSION
from async_vla.policy.prismatic import PRISMATIC_TIMM_VERSIONS, check_remote_code_dependencies

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
GPU = {Requirement(r).name: Requirement(r) for r in PROJECT["optional-dependencies"]["gpu"]}


def _pin(name: str) -> str:
    (spec,) = GPU[name].specifier
    assert spec.operator == "==", f"gpu extra: {name} must be pinned with ==, got {spec}"
    return spec.version


def test_every_gpu_requirement_is_pinned_and_meets_the_core_lower_bounds():
    for name in GPU:
        _pin(name)
    for req in map(Requirement, PROJECT["dependencies"]):
        if req.name in GPU:
            assert req.specifier.contains(_pin(req.name)), f"core {req} rejects the gpu pin {req.name}=={_pin(req.name)}"
    assert {"torch", "vllm", "transformers", "deepspeed", "timm", "accelerate", "peft"} <= GPU.keys()


def test_version_guards_agree_with_the_pins():
    assert VLLM_VERSION == _pin("vllm")                       # actors/vllm_backend.py warns on any other vLLM
    assert _pin("timm") in PRISMATIC_TIMM_VERSIONS            # modeling_prismatic.py raises on any other timm
    assert int(_pin("transformers").split(".")[0]) == 4       # the Prismatic processor imports what 5.x removed


def test_remote_code_dependencies_are_refused_before_loading(tmp_path):
    import importlib.metadata as md

    (tmp_path / "modeling_prismatic.py").write_text("import timm\n")
    have = None
    try:
        have = md.version("timm")
    except md.PackageNotFoundError:
        pass
    if have in PRISMATIC_TIMM_VERSIONS:
        check_remote_code_dependencies(tmp_path)
    else:
        with pytest.raises(RuntimeError, match=r"timm .*0\.9\.16.*\[gpu\]"):
            check_remote_code_dependencies(tmp_path)
    (tmp_path / "modeling_prismatic.py").write_text("import torch\n")
    (tmp_path / "processing_prismatic.py").write_text("from transformers.tokenization_utils import PaddingStrategy\n")
    if int(md.version("transformers").split(".")[0]) >= 5:
        with pytest.raises(RuntimeError, match="transformers 5 removed"):
            check_remote_code_dependencies(tmp_path)
    else:
        check_remote_code_dependencies(tmp_path)


def _cert_args() -> list[str]:
    cert = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True,
                          text=True).stdout.strip()
    return ["--cert", cert] if cert else []


def _index_reachable() -> bool:
    """Whether pip's default index answers, asked the way the dry run below asks it (--isolated)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "pip", "--isolated", "--disable-pip-version-check",
           *_cert_args()]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_stack_resolves_with_pips_resolver(tmp_path):
    """`pip install --dry-run --ignore-installed --report` of core + gpu + dev requirements against PyPI alone
    (--isolated: no local indexes or constraints): the set installs together, torch is PyPI's CUDA build, and the
    versions pip picks for the pinned packages are the pins."""
    if not _index_reachable():
        pytest.skip("PyPI cannot be reached from this machine: the GPU stack's resolution was NOT checked")
    reqs = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["gpu"] + PROJECT["optional-dependencies"]["dev"]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", *_cert_args(), "--report", str(report), *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, f"pip could not resolve the gpu stack:\n{done.stderr[-4000:]}"
    picked = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    for name in GPU:
        assert picked[name.lower()] == _pin(name), f"{name}: pip picked {picked[name.lower()]}, the pin is {_pin(name)}"
    assert any(re.match(r"nvidia-cuda-runtime", n) for n in picked), "torch from PyPI did not pull the CUDA runtime"
