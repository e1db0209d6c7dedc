"""Weight broadcast, the pieces without a socket: bucket layout and packing, checksums, exports, the buffer pool."""

from __future__ import annotations

import json

import pytest
import torch

from async_vla.messages import ROOT, PolicyTag
from async_vla.weights.buckets import Layout, checksum, plan, spec_of, unpack
from async_vla.weights.packer import pack
from async_vla.weights.export import export_weights, read_latest, write_safetensors
from async_vla.weights.pool import BufferPool
from tests.weight_helpers import mixed_model


# ----------------------------------------------------------------------------------- layout, checksum, export
def test_bucket_roundtrip_mixed_dtypes_and_caps():
    model = mixed_model(0)
    model["transposed"] = torch.randn(40, 30).t()                       # non-contiguous input
    for cap in (1, 4096, 256 * 1024, 1 << 30):
        layout, buckets = pack(model.items(), cap)
        # The receiver derives the identical layout from the manifest alone.
        assert Layout.from_manifest_bytes(layout.manifest_bytes()) == layout
        assert plan([spec_of(n, t) for n, t in model.items()], cap) == layout
        out = unpack(layout, buckets)
        assert list(out) == list(model)
        for name, t in model.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape
            assert torch.equal(out[name], t), name
        assert checksum(out) == checksum(model)
        for b, spec in zip(buckets, layout.buckets):
            assert b.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                               "int64": torch.int64, "bool": torch.bool}[spec.dtype]
            members = [e for e in layout.entries if buckets[e.bucket] is b]
            if b.numel() * b.element_size() > cap:                       # only a lone oversize tensor exceeds it
                assert len(members) == 1
        assert all(e.offset * torch.empty(0, dtype=buckets[e.bucket].dtype).element_size() % 64 == 0
                   for e in layout.entries)
    big = plan([spec_of(n, t) for n, t in model.items()], 256 * 1024)
    own = [e for e in big.entries if e.spec.name == "head.big"][0]
    assert [e.spec.name for e in big.entries if e.bucket == own.bucket] == ["head.big"]
    per_tensor = plan([spec_of(n, t) for n, t in model.items()], 1)
    assert len(per_tensor.buckets) >= len(model) - 1                    # the empty tensor shares a bucket


def test_checksum_is_exact_order_independent_and_sensitive():
    a = mixed_model(1)
    assert checksum(a) == checksum(dict(reversed(list(a.items()))))
    assert checksum(a) == checksum({k: v.clone() for k, v in a.items()})
    assert 0 <= checksum(a) < 2**52
    b = {k: v.clone() for k, v in a.items()}
    b["layers.1.attn.qkv"][3, 5] += 1e-3
    assert checksum(b) != checksum(a)
    b = {k: v.clone() for k, v in a.items()}
    b["mask"][0] = ~b["mask"][0]
    assert checksum(b) != checksum(a)
    # A view at an unaligned offset gives the same value as its copy.
    base = torch.randn(1001)
    assert checksum({"x": base[1:]}) == checksum({"x": base[1:].clone()})


@pytest.mark.parametrize("cap", [256, 64 * 1024, 1 << 30])
def test_the_packers_checksum_equals_the_checksum_of_the_model_with_or_without_a_helper_thread(cap):
    from concurrent.futures import ThreadPoolExecutor

    from async_vla.weights.packer import BucketPacker

    model = mixed_model(3, scale=2)
    with ThreadPoolExecutor(1) as ex:
        for summer in (None, ex):
            packer = BucketPacker(cap, summer=summer)
            for name, t in reversed(list(model.items())):      # any order in, the same value out
                packer.add(name, t)
            layout, buckets = packer.finish()
            assert packer.checksum() == checksum(model) == checksum(unpack(layout, buckets))
        small = BucketPacker(cap, summer=ex)
        small._summer.BATCH = 1                                  # one hand-off per tensor: same value
        for name, t in model.items():
            small.add(name, t)
        assert small.checksum() == checksum(model)


def test_the_same_tensors_reuse_the_previous_layout_and_any_change_makes_a_new_one():
    from async_vla.weights.packer import BucketPacker

    def packed(model, previous=None):
        packer = BucketPacker(64 * 1024, previous=previous)
        for name, t in model.items():
            packer.add(name, t)
        layout, buckets = packer.finish()
        assert checksum(unpack(layout, buckets)) == checksum(model)
        return layout

    first = packed(mixed_model(1))
    again = packed(mixed_model(2), previous=first)           # new values, same names / dtypes / shapes
    assert again is first
    renamed = dict(mixed_model(2))
    renamed["steps2"] = renamed.pop("steps")
    reshaped = {**mixed_model(2), "temperature": torch.tensor([1.5])}
    for changed in (renamed, reshaped):
        fresh = packed(changed, previous=first)
        assert fresh is not first and fresh == plan([spec_of(n, t) for n, t in changed.items()], 64 * 1024)
    assert packed(mixed_model(2), previous=plan(first.specs, 1024)) is not first     # another cap


def test_manifest_validation_rejects_malformed():
    good = plan([spec_of("a", torch.zeros(3))], 1024).manifest_bytes()
    doc = json.loads(good)
    bad = [b"not json", json.dumps({**doc, "schema": 9}).encode(), json.dumps({**doc, "cap": -1}).encode(),
           json.dumps({**doc, "tensors": [["a", "complex64", [3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [-3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [3]], ["a", "float32", [3]]]}).encode(),
           json.dumps({**doc, "tensors": [["a", "float32", [1] * 9]]}).encode()]
    for raw in bad:
        with pytest.raises(ValueError):
            Layout.from_manifest_bytes(raw)


def test_export_pointer_pruning_and_standard_reader(tmp_path):
    from safetensors.torch import load_file

    model = mixed_model(2)
    for v in (1, 2, 3):
        export_weights(tmp_path, v, model, checksum(model), keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v2.safetensors", "v3.safetensors"]
    assert (tmp_path / "latest").read_text().strip() == "v3.safetensors"
    tag, tensors, csum = read_latest(tmp_path)
    assert tag == PolicyTag(ROOT, 3) and csum == checksum(model) and checksum(tensors) == csum
    assert read_latest(tmp_path, newer_than=PolicyTag(ROOT, 3)) is None
    assert read_latest(tmp_path, newer_than=PolicyTag(ROOT, 2))[0].version == 3
    std = load_file(str(tmp_path / "v3.safetensors"))                 # the stock reader agrees
    assert all(torch.equal(std[k], model[k]) for k in model)
    (tmp_path / "latest").write_text("../../etc/passwd")               # an untrusted pointer is not followed
    assert read_latest(tmp_path)[0].version == 3
    layout, buckets = pack(model.items(), 4096)                        # views sharing storage export fine
    write_safetensors(tmp_path / "views.safetensors", unpack(layout, buckets))
    assert checksum(load_file(str(tmp_path / "views.safetensors"))) == checksum(model)


def test_buffer_pool_never_reuses_a_buffer_someone_still_views():
    pool = BufferPool()
    a = pool.get(1000, torch.float32, "cpu")
    b = pool.get(1000, torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()                               # a is held: not handed out twice
    view = b[10:20]
    a_ptr = a.data_ptr()
    del a, b
    c = pool.get(1000, torch.float32, "cpu")
    assert c.data_ptr() == a_ptr                                      # a is free again
    assert pool.get(1000, torch.float32, "cpu").data_ptr() not in (a_ptr, view.data_ptr() - 40)
    layout, buckets = pack(mixed_model(0).items(), 4096, pool=pool)
    held = unpack(layout, buckets)
    before = checksum(held)
    ptrs = {b.data_ptr() for b in buckets}
    del buckets
    layout2, buckets2 = pack(mixed_model(1).items(), 4096, pool=pool)      # same shapes: must not overwrite `held`
    assert checksum(held) == before
    assert not ptrs & {b.data_ptr() for b in buckets2}
    del held
    ptrs |= {b.data_ptr() for b in buckets2}
    del buckets2
    _, buckets3 = pack(mixed_model(2).items(), 4096, pool=pool)
    assert {b.data_ptr() for b in buckets3} <= ptrs                   # released buffers are reused
    pool.trim(0)                                                       # drops only buffers nobody views
    assert len(pool._bufs) == len(buckets3) + 2                        # buckets3, `c` and `view` are held
    del buckets3, c, view
    pool.trim(0)
    assert pool._bufs == []
