"""bin/train's checks before anything starts (runner.preflight): files, ports and --resume, each error naming the
field and the fix; and bin/train itself exits 2 on them in about a second, having started nothing."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_vla.config import load_config
from runner.preflight import preflight

REPO = Path(__file__).resolve().parent.parent
FREE_PORTS = ["transport.trajectory_port=0", "transport.control_port=0", "transport.batch_port=0",
              "transport.weights_port=0"]


def test_a_missing_or_wrong_policy_path_is_an_error_naming_the_field(tmp_path):
    errors, _ = preflight(load_config(None, [f"policy.path={tmp_path / 'nope'}"]), tmp_path / "run", False)
    assert len(errors) == 1 and errors[0].startswith("policy.path: ") and "bin/sft" in errors[0]
    (tmp_path / "empty").mkdir()
    errors, _ = preflight(load_config(None, [f"policy.path={tmp_path / 'empty'}"]), tmp_path / "run", False)
    assert len(errors) == 1 and "has no async_vla_policy.json" in errors[0]
    (tmp_path / "empty" / "async_vla_policy.json").write_text("{}")
    assert preflight(load_config(None, [f"policy.path={tmp_path / 'empty'}"]), tmp_path / "run", False)[0] == []


def test_a_user_deepspeed_json_must_be_a_readable_json_object(tmp_path):
    ports = ["transport.trajectory_port=0", "transport.control_port=0",
             "transport.batch_port=0", "transport.weights_port=0"]

    def errors_for(path):
        return preflight(load_config(None, ports + [f"learner.deepspeed_config={path}"]), tmp_path / "run", False)[0]

    assert errors_for(tmp_path / "missing.json")[0].startswith("learner.deepspeed_config: cannot read")
    (tmp_path / "bad.json").write_text("{stage: 3")
    assert "not valid JSON" in errors_for(tmp_path / "bad.json")[0]
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "not an object" in errors_for(tmp_path / "list.json")[0]
    (tmp_path / "ok.json").write_text('{"zero_optimization": {"stage": 2}}')
    assert errors_for(tmp_path / "ok.json") == []


def test_curve_keys_must_load_before_anything_starts(tmp_path):
    base = ["transport.trajectory_port=0", "transport.control_port=0",
            "transport.batch_port=0", "transport.weights_port=0",
            "transport.curve=true", f"transport.curve_dir={tmp_path / 'keys'}"]
    errors = preflight(load_config(None, base), tmp_path / "run", False)[0]
    assert len(errors) == 1 and errors[0].startswith("transport.curve_dir: ") and "bin/keys" in errors[0]
    (tmp_path / "keys").mkdir()
    errors = preflight(load_config(None, base), tmp_path / "run", False)[0]
    assert len(errors) == 1 and errors[0].startswith("transport.curve_dir: server keys") and "bin/keys" in errors[0]
    made = subprocess.run([sys.executable, str(REPO / "bin" / "keys"), str(tmp_path / "keys")], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert preflight(load_config(None, base), tmp_path / "run", False)[0] == []
    (tmp_path / "keys" / "client.key_secret").unlink()
    assert preflight(load_config(None, base), tmp_path / "run", False)[0][0].startswith("transport.curve_dir: client")


def test_serial_mode_says_which_process_counts_it_ignores(tmp_path):
    cfg = load_config(None, ["run.mode=serial", "learner.num_ranks=2", "buffer.groups_per_batch=4"])
    errors, warnings = preflight(cfg, tmp_path / "run", False)
    assert errors == [] and any("learner.num_ranks=2 ignored" in w for w in warnings), warnings
    assert not any("ignored" in w for w in preflight(load_config(None, ["run.mode=serial"]), tmp_path, False)[1])


def test_an_untrained_tiny_policy_is_a_warning_not_an_error(tmp_path):
    errors, warnings = preflight(load_config(None, ["transport.trajectory_port=0", "transport.control_port=0",
                                                    "transport.batch_port=0",
                                                    "transport.weights_port=0"]), tmp_path, False)
    assert errors == [] and len(warnings) == 1 and "random weights" in warnings[0] and "bin/sft" in warnings[0]


def test_resume_of_nothing_starts_fresh_with_a_warning_and_warns_without_a_checkpoint(tmp_path):
    cfg = load_config(None, ["run.mode=serial"])
    errors, warnings = preflight(cfg, tmp_path / "never", True)   # a requeued job's first submission
    assert errors == [] and any(w.startswith("--resume: ") and "starting a new one" in w for w in warnings)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}")
    errors, warnings = preflight(cfg, tmp_path / "run", True)
    assert errors == [] and any("no checkpoint" in w for w in warnings)


def test_resume_on_another_number_of_deepspeed_ranks_is_an_error(tmp_path):
    run = tmp_path / "run"
    tag = run / "checkpoints" / "v00000004"
    tag.mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "checkpoints" / "latest").write_text("v00000004")
    for r in range(2):   # what a 2-rank DeepSpeed learner leaves beside its ZeRO partitions
        (tag / f"rng_rank{r:05d}.pt").write_bytes(b"")
    ports = ["transport.trajectory_port=0", "transport.control_port=0",
             "transport.batch_port=0", "transport.weights_port=0"]
    errors = preflight(load_config(None, ports + ["learner.num_ranks=1"]), run, True)[0]
    assert len(errors) == 1 and "learner.num_ranks=1" in errors[0] and "learner.num_ranks=2" in errors[0]
    assert preflight(load_config(None, ports + ["learner.num_ranks=2"]), run, True)[0] == []
    not_resuming = preflight(load_config(None, ports + ["learner.num_ranks=1"]), run, False)[0]
    assert len(not_resuming) == 1 and "holds a run already" in not_resuming[0]   # that, not the rank count


def test_a_new_run_into_a_run_directory_is_refused_and_the_run_there_is_left_as_it_was(tmp_path):
    run = tmp_path / "x"
    run.mkdir()
    files = {"config.yaml": "{}", "summary.json": '{"final_eval": {"success": 0.9}}', "ledger.json": "[]"}
    for name, text in files.items():
        (run / name).write_text(text)
    out = subprocess.run([sys.executable, str(REPO / "bin" / "train"), str(REPO / "configs" / "quickstart.yaml"),
                          f"run.out_dir={tmp_path}", "run.name=x", "run.mode=serial"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "cannot start:" in out.stderr, out.stderr
    assert f"{run} holds a run already" in out.stderr and "--resume" in out.stderr and "run.name" in out.stderr
    assert {p.name: p.read_text() for p in run.iterdir()} == files
    # an empty directory, or one without a run's config.yaml, is not a run
    assert not any("holds a run" in e for e in preflight(load_config(None, ["run.mode=serial"]), tmp_path, False)[0])


def test_a_port_in_use_names_its_field_and_port_zero_never_clashes(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = load_config(None, [f"transport.control_port={port}", "transport.trajectory_port=0",
                                 "transport.batch_port=0", "transport.weights_port=0"])
        errors, _ = preflight(cfg, tmp_path, False)
        assert len(errors) == 1 and errors[0].startswith("transport.control_port: ") and f":{port} " in errors[0]
        assert "transport.control_port=0" in errors[0]
        assert preflight(load_config(None, [f"transport.control_port={port}", "run.mode=serial"]), tmp_path,
                         False)[0] == []                          # serial mode listens on nothing
        serve = load_config(None, ["run.mode=serial", "logging.serve_tensorboard=true",
                                   f"logging.tensorboard_port={port}"])
        assert preflight(serve, tmp_path, False)[0][0].startswith("logging.tensorboard_port: ")


def _v6_listener():
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind(("::1", 0))
    except OSError:
        return None
    s.listen(1)
    return s


def test_an_ipv6_host_is_checked_as_ipv6(tmp_path):
    busy = _v6_listener()
    if busy is None:
        pytest.skip("no IPv6 loopback on this machine")
    with busy:
        port = busy.getsockname()[1]
        cfg = load_config(None, ["run.mode=serial", "logging.serve_tensorboard=true",
                                 "logging.tensorboard_host=::1", f"logging.tensorboard_port={port}"])
        errors = preflight(cfg, tmp_path, False)[0]
        assert len(errors) == 1 and "already in use" in errors[0] and "[::1]" not in errors[0], errors
    free = load_config(None, ["run.mode=serial", "logging.serve_tensorboard=true", "logging.tensorboard_host=::1",
                              f"logging.tensorboard_port={port}"])
    assert preflight(free, tmp_path, False)[0] == []      # closed again: free (not "unknown address family")


def test_bin_train_stops_on_them_before_starting_anything(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bin" / "train"), str(REPO / "configs" / "quickstart.yaml"),
                          f"run.out_dir={tmp_path}", "run.name=x", f"policy.path={tmp_path / 'nope'}"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "cannot start:" in out.stderr and "policy.path: " in out.stderr
    assert not (tmp_path / "x").exists()                         # no run directory, no process


@pytest.mark.parametrize("proc_line,driver", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024", "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)", "580.65.06"),
])
def test_the_driver_version_is_read_from_its_proc_entry(tmp_path, proc_line, driver):
    from runner.preflight import host_cuda

    (tmp_path / "version").write_text(proc_line + "\nGCC version:  gcc version 12.2.0\n")
    torch_version, torch_cuda, found = host_cuda(tmp_path / "version")
    assert found == driver and torch_version == torch.__version__ and torch_cuda == torch.version.cuda
    assert host_cuda(tmp_path / "absent")[2] is None


def test_a_cuda_build_of_torch_the_driver_cannot_run_is_named_with_the_fix():
    """PyPI's torch 2.11.0 Linux wheel is a CUDA 13 build: a driver older than 580 leaves torch.cuda.is_available()
    False. Said with the fix: a newer driver or PyTorch's CUDA 12 build of the same pins (driver >= 525)."""
    from runner.preflight import cuda_driver_problem

    old = cuda_driver_problem("2.11.0", "13.0", "550.54.15")
    assert "CUDA 13.0 build" in old and "driver >= 580" in old and "550.54.15" in old
    assert "torch==2.11.0" in old and "--index-url https://download.pytorch.org/whl/cu128" in old
    too_old = cuda_driver_problem("2.11.0", "13.0", "470.239.06")
    assert "driver to >= 580" in too_old and "cu128" not in too_old        # no CUDA 12 build runs there either
    assert cuda_driver_problem("2.11.0+cu128", "12.8", "550.54.15") is None
    assert cuda_driver_problem("2.11.0", "13.0", "580.65.06") is None
    assert cuda_driver_problem("2.11.0", "13.0", None) is None                # no NVIDIA driver: nothing to fit
    assert "CPU build" in cuda_driver_problem("2.13.0+cpu", None, "580.65.06")


def test_preflight_refuses_a_placed_run_whose_torch_cannot_use_the_driver(tmp_path, monkeypatch):
    import runner.preflight as pf

    monkeypatch.setattr(pf, "host_cuda", lambda: ("2.11.0", "13.0", "550.54.15"))
    placed = load_config(None, ["placement.gpus_learner=[0]", *FREE_PORTS])
    errors, _ = pf.preflight(placed, tmp_path / "run", False)
    assert any("needs an NVIDIA driver >= 580" in e for e in errors), errors
    unplaced = load_config(None, FREE_PORTS)
    errors, warnings = pf.preflight(unplaced, tmp_path / "run2", False)
    assert not any("driver" in e for e in errors) and any("needs an NVIDIA driver >= 580" in w for w in warnings)
