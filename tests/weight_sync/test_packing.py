"""Packing: a bucket is its regions' bytes back to back, in plan order, whatever the dtypes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.weight_sync.packing import offsets, pack_bucket, torch_dtype, unpack_bucket
from megarl.weight_sync.planner import Bucket, TensorMeta, Transfer
from megarl.weight_sync.regions import region_numel

FULL = {
    "a": torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "b": torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),
    "c": torch.arange(7, dtype=torch.int64),
}
META = {name: TensorMeta(tuple(t.shape), t.element_size(), str(t.dtype).removeprefix("torch.")) for name, t in FULL.items()}


def transfer(name, region):
    return Transfer(0, (1,), name, region, region_numel(region) * META[name].itemsize)


# bf16 3x3 = 18 bytes first, so "b" starts at a misaligned offset for fp32; "c" at 18 + 24 = 42 (not a multiple of 8)
BUCKET = Bucket(0, (1,), [transfer("a", ((1, 4), (1, 4))), transfer("b", ((2, 4), (2, 5))), transfer("c", ((2, 6),))])


def reference_bytes(bucket):
    """Straightforward: each region's elements in C order, as raw bytes, concatenated."""
    out = b""
    for t in bucket.transfers:
        piece = FULL[t.name][tuple(slice(a, b) for a, b in t.region)].contiguous()
        if piece.dtype == torch.bfloat16:
            piece = piece.view(torch.int16)
        out += piece.numpy().tobytes()
    return out


def get_region(name, region):
    return FULL[name][tuple(slice(a, b) for a, b in region)]  # a non-contiguous view


def test_pack_writes_the_regions_bytes_in_plan_order():
    buffer = torch.full((BUCKET.nbytes + 10,), 255, dtype=torch.uint8)
    packed = pack_bucket(BUCKET, META, get_region, buffer)
    assert packed.numel() == BUCKET.nbytes == 18 + 24 + 32
    assert packed.numpy().tobytes() == reference_bytes(BUCKET)
    assert (buffer[BUCKET.nbytes:] == 255).all()  # nothing written past the bucket
    assert offsets(BUCKET) == [0, 18, 42]


def test_unpack_restores_every_region_exactly():
    raw = torch.from_numpy(np.frombuffer(reference_bytes(BUCKET), dtype=np.uint8).copy())
    pieces = unpack_bucket(BUCKET, META, raw)
    assert [t for t, _ in pieces] == BUCKET.transfers
    for t, data in pieces:
        expected = get_region(t.name, t.region)
        assert data.dtype == expected.dtype and data.shape == expected.shape
        assert torch.equal(data, expected)


def test_aligned_regions_are_views_and_misaligned_ones_copies():
    buffer = torch.empty(BUCKET.nbytes, dtype=torch.uint8)
    pack_bucket(BUCKET, META, get_region, buffer)
    base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    inside = [base <= data.data_ptr() < end for _, data in unpack_bucket(BUCKET, META, buffer)]
    assert inside == [True, False, False]  # offset 0 aligned; 18 (fp32) and 42 (int64) are not


def test_pack_rejects_a_region_of_the_wrong_shape_or_dtype():
    buffer = torch.empty(BUCKET.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"returned torch.float32 \(3, 3\); the plan expects torch.bfloat16"):
        pack_bucket(BUCKET, META, lambda n, r: get_region(n, r).float(), buffer)
    with pytest.raises(ValueError, match="pack buffer must be 1-D uint8"):
        pack_bucket(BUCKET, META, get_region, torch.empty(4, dtype=torch.uint8))


def test_dtype_names_are_checked():
    assert torch_dtype(TensorMeta((2,), 2, "bfloat16")) is torch.bfloat16
    with pytest.raises(ValueError, match="not a torch dtype name"):
        torch_dtype(TensorMeta((2,), 4, "float99"), "w")
    with pytest.raises(ValueError, match="itemsize=2 but float32 has 4"):
        torch_dtype(TensorMeta((2,), 2, "float32"), "w")
