"""Suite-wide rules and fixtures. A test marked `gpu` is skipped (with the reason) on a machine without CUDA,
whatever the test itself checks, so a future GPU test cannot run half-way on a CPU machine and fail or, worse,
pass. ``dist_env``: a one-process torch.distributed world for in-process DeepSpeed engines."""

import os
import socket

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


@pytest.fixture(scope="module")
def dist_env():
    """One-process world for in-process DeepSpeed engines (the process group outlives the tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
