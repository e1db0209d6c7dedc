"""Suite-wide rules and fixtures. A test marked `gpu` is skipped (with the reason) on a machine without CUDA,
whatever the test itself checks, so a future GPU test cannot run half-way on a CPU machine and fail or, worse,
pass. ``dist_env``: a one-process torch.distributed world for in-process DeepSpeed engines."""

import os
import socket

import pytest


def pytest_collection_modifyitems(config, items):
    _longest_files_first(config, items)
    _skip_gpu_tests_without_cuda(items)


def _longest_files_first(config, items):
    """Files with `slow` tests first, those with the longest declared timeout ahead: bin/test hands whole files to
    two xdist workers in this order (--dist loadfile --no-loadscope-reorder), so a long file that came last would
    leave one worker running it alone while the other idles; the many short files then fill in at the end. The
    timeout stands in for a file's cost because every long test must declare one above the suite-wide bound."""
    try:
        default_timeout = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed: no ini key
        default_timeout = 0.0
    first_seen, key = {}, {}
    for item in items:
        path = str(item.path)
        first_seen.setdefault(path, len(first_seen))
        marker = item.get_closest_marker("timeout")
        timeout = float(marker.args[0]) if marker is not None and marker.args else default_timeout
        slow = item.get_closest_marker("slow") is not None
        was_slow, was_timeout = key.get(path, (False, 0.0))
        key[path] = (was_slow or slow, max(was_timeout, timeout if slow else 0.0))
    # stable: a file's tests keep their order and stay together
    items.sort(key=lambda item: (not key[str(item.path)][0], -key[str(item.path)][1], first_seen[str(item.path)]))


def _skip_gpu_tests_without_cuda(items):
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
