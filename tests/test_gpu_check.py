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
