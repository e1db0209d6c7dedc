"""async_vla.weights.native: the copy-with-checksum kernel against torch (the slow, obvious reference), and the packer
with and without it."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from async_vla.weights import native
from async_vla.weights.buckets import checksum, tensor_sum, tensor_sum_torch, unpack
from async_vla.weights.packer import SPLIT_BYTES, BucketPacker

needs_native = pytest.mark.skipif(not native.available(), reason=native.status())

def _copy_sum(dst: torch.Tensor, src: torch.Tensor) -> int:
    return native.copy_sum_raw(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


SIZES = [0, 1, 7, 8, 9, 15, 16, 63, 64, 255, 256, 257, 1000, 4096 + 24, 1 << 20, (1 << 20) + 13]


def test_the_set_up_builds_the_kernel_wherever_there_is_a_c_compiler():
    # bin/test's set-up builds it; a build step that silently stopped working would otherwise only show as
    # slower packing.
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the torch fallback is what runs")
    assert native.available(), native.status()
    assert native.status() == "native"


def _bytes(n: int, offset: int = 0) -> torch.Tensor:
    """n random bytes starting ``offset`` bytes into a fresh storage (an unaligned view when offset % 8)."""
    g = torch.Generator().manual_seed(n * 31 + offset)
    return torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=g)[offset:]


@needs_native
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_off, dst_off", [(0, 0), (3, 0), (0, 5), (11, 8), (8, 16)])
def test_copy_sum_copies_exactly_and_sums_like_tensor_sum(n, src_off, dst_off):
    src = _bytes(n, src_off)
    dst_base = torch.zeros(n + dst_off + 64, dtype=torch.uint8)
    dst = dst_base[dst_off:dst_off + n]
    total = _copy_sum(dst, src)
    assert total == tensor_sum_torch(src)
    assert torch.equal(dst, src)
    assert not dst_base[:dst_off].any() and not dst_base[dst_off + n:].any()   # nothing written outside


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_copy_sum_and_byte_sum_on_typed_tensors_equal_the_torch_reference(dtype):
    for numel in (1, 3, 1025, 70_001):
        src = _bytes(numel * torch.empty((), dtype=dtype).element_size()).view(dtype)
        if dtype == torch.bool:
            src = src.view(torch.uint8).remainder(2).to(torch.bool)
        dst = torch.empty_like(src)
        assert _copy_sum(dst, src) == tensor_sum_torch(src) == native.byte_sum(src)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        assert tensor_sum(dst) == tensor_sum_torch(dst)


@needs_native
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("off", [0, 1, 4, 8])
def test_byte_sum_equals_the_torch_reference_at_any_offset(n, off):
    t = _bytes(n, off)
    assert native.byte_sum(t) == tensor_sum_torch(t)


@needs_native
def test_what_the_kernel_cannot_take_is_summed_by_torch():
    src = torch.randn(8, 8)
    assert native.byte_sum(src.t()) is None                        # not contiguous
    assert native.byte_sum(src._neg_view()) is None                # lazily negated view: the bytes are not the values
    assert tensor_sum(src.t()) == tensor_sum_torch(src.t().contiguous())


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    if request.param == "native" and not native.available():
        pytest.skip(native.status())
    if request.param == "torch":
        monkeypatch.setattr(native, "_load", lambda: (None, "disabled by the test"))
    return request.param


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(300, 64, generator=g), "qkv": torch.randn(192, 64, generator=g),
            "bias": torch.randn(3, generator=g), "half": torch.randn(1001, generator=g).to(torch.bfloat16),
            "steps": torch.arange(5), "mask": torch.rand(17, generator=g) > 0.5,
            "strided": torch.randn(64, 32, generator=g).t(),
            # Above SPLIT_BYTES: copied in two halves at once; odd byte counts put trailing bytes in the far half.
            "big": torch.randn(1_100_001, generator=g), "big_half": torch.randn(2_200_001, generator=g).half()}


@pytest.mark.parametrize("cap", [512, 64 * 1024, 1 << 30])
def test_packing_gives_the_same_buckets_and_checksum_with_the_kernel_or_torch(kernel, cap):
    model = _model()
    assert model["big_half"].nbytes > SPLIT_BYTES and model["big_half"].nbytes % 8
    with ThreadPoolExecutor(1) as ex:
        for summer in (None, ex):
            packer = BucketPacker(cap, summer=summer)
            assert packer._native == (kernel == "native")
            for name, t in model.items():
                packer.add(name, t)
            layout, buckets = packer.finish()
            got = unpack(layout, buckets)
            assert all(torch.equal(got[k], v) for k, v in model.items())
            assert packer.checksum() == checksum(model)
    # Both kernels agree on the value itself, not only each with itself.
    assert checksum(model) == checksum({k: v.contiguous() for k, v in model.items()})
    ref = 0
    for name in sorted(model):
        ref = (ref * 1_000_003 + tensor_sum_torch(model[name]) + model[name].numel()) % (1 << 52)
    assert checksum(model) == float(ref)
