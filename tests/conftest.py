"""Suite-wide rules: a test marked `gpu` is skipped (with the reason) on a machine without CUDA, whatever the
test itself checks, so a future GPU test cannot run half-way on a CPU machine and fail or, worse, pass."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: keeps `pytest tests/test_config.py` light

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU (none on this machine)")
    for item in gpu_items:
        item.add_marker(skip)
