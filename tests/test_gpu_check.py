"""bin/gpu-check on a machine without CUDA says so and fails; its table and NCCL bucketing are checked here too (the
checks themselves need a GPU: docs/GPU.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.gpu_check import BUCKET_BYTES, Row, _buckets, gpu_test_files, layer_like_sizes, libero_episode, table

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bin/gpu-check would run the checks")
def test_without_a_gpu_it_says_nothing_was_checked_and_fails():
    done = subprocess.run([sys.executable, str(REPO / "bin" / "gpu-check")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "no CUDA GPU on this machine" in done.stderr and "nothing was checked" in done.stderr


def test_buckets_cover_every_tensor_once_within_the_cap():
    sizes = layer_like_sizes(layers=2, hidden=1024) + [3 * BUCKET_BYTES]        # one larger than a bucket
    groups = _buckets(sizes, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(len(g) == 1 or sum(sizes[i] for i in g) * 2 <= BUCKET_BYTES for g in groups)


def test_table_and_the_episode_row_without_a_checkpoint():
    row = libero_episode("configs/libero_spatial.yaml", [])
    assert row.status == "skipped" and "policy.path" in row.detail
    text = table([Row("gpu tests (pytest -m gpu)", "ok", "4 passed"), row])
    lines = text.splitlines()
    assert lines[0].split() == ["check", "status", "detail"] and len(lines) == 4
    assert lines[3].startswith("greedy LIBERO episode") and "skipped" in lines[3]


def test_the_gpu_tests_are_collected_from_the_files_that_mark_them(tmp_path):
    files = gpu_test_files()
    assert "tests/test_weights.py" in files and "tests/test_vllm_backend.py" in files
    assert "tests/test_ray_launcher.py" not in files          # needs Ray, which a GPU host may lack
    assert "tests/test_gpu_check.py" not in files             # names the mark in a string only
    (tmp_path / "test_marked.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    (tmp_path / "test_module_mark.py").write_text("import pytest\n\npytestmark = [pytest.mark.gpu]\n")
    (tmp_path / "test_mentions.py").write_text("# pytest.mark.gpu is what bin/gpu-check looks for\n")
    assert [Path(f).name for f in gpu_test_files(tmp_path, root=tmp_path)] == ["test_marked.py", "test_module_mark.py"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scale_at_the_tiny_size_measures_every_row_and_writes_the_doc_block(tmp_path):
    """`bin/gpu-check --scale --size tiny`: the 7B check's code path (OFT-shaped model, actor forward, ZeRO-3 learner
    steps with LoRA and full fine-tuning, the weight hand-off) on a tiny model, here on the CPU; the table replaces
    the marked block of the doc it is given and nothing else."""
    from runner.gpu_scale import BEGIN, END

    doc = tmp_path / "GPU.md"
    doc.write_text(f"# before\n\n{BEGIN}\nnot measured yet\n{END}\n\n# after\n")
    done = subprocess.run([sys.executable, str(REPO / "bin" / "gpu-check"), "--scale", "--size", "tiny", "--doc",
                           str(doc)], capture_output=True, text=True, timeout=540, cwd=str(REPO))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith(f"# before\n\n{BEGIN}\n`bin/gpu-check --scale` on ") and text.endswith(f"{END}\n\n# after\n")
    assert "not measured yet" not in text and "tiny shape" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| measurement") and not line.startswith("| ---")}
    actor = next(v for k, v in rows.items() if k.startswith("actor forward, 8 envs"))
    lora = next(v for k, v in rows.items() if k.startswith("learner step, ZeRO-3") and "LoRA r=4" in k)
    full = next(v for k, v in rows.items() if k.startswith("learner step, ZeRO-3") and "full fine-tuning" in k)
    handoff = next(v for k, v in rows.items() if k.startswith("weight hand-off"))
    assert actor.endswith(" ms/call") and all(v.endswith(" s") for v in (lora, full, handoff)), rows


def test_where_full_fine_tuning_of_the_7b_shape_fits_on_one_gpu():
    from runner.gpu_scale import full_ft_plan

    n = 7_541_235_136                                              # the --scale model (OpenVLA-OFT's count)
    assert full_ft_plan(n, 80 * 10**9, 128 * 10**9)[0] is None     # H100 80 GB, 128 GB host: neither way
    plan, note = full_ft_plan(n, 80 * 10**9, 256 * 10**9)
    assert plan == {"offload_optimizer": {"device": "cpu", "pin_memory": False}} and "offloaded" in note
    assert full_ft_plan(n, 149 * 10**9, 128 * 10**9)[0] == {}      # H200: no offload (~139 GB)
    assert full_ft_plan(10**6, None, 0) == ({}, "no offload (CPU)")
