"""TransferMesh v1 buckets: checksums, whole-version-or-nothing, no shared storage."""

import pytest
import torch

from transfer_mesh.buckets import IntegrityError, pack_version, unpack_version


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.bias": torch.randn(32, generator=g),
        "c.weight": torch.randn(128, 16, generator=g).to(torch.bfloat16),
    }


def test_round_trip_in_small_buckets_shares_no_storage():
    src = _tensors()
    buckets = pack_version(src, version=3, bucket_bytes=4096)
    assert len(buckets) >= 2
    version, out = unpack_version(buckets, {k: tuple(v.shape) for k, v in src.items()})
    assert version == 3
    for k, v in src.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype
        assert out[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


def test_corrupt_missing_or_misshaped_versions_are_refused():
    src = _tensors()
    buckets = pack_version(src, version=1, bucket_bytes=4096)
    corrupt = list(buckets)
    b = corrupt[0]
    corrupt[0] = type(b)(b.version, b.index, b.total, b.metas, b"\x00" + b.data[1:], b.sha256)
    with pytest.raises(IntegrityError, match="checksum"):
        unpack_version(corrupt)
    with pytest.raises(IntegrityError, match="expected 0.."):
        unpack_version(buckets[1:])
    shapes = {k: tuple(v.shape) for k, v in src.items()}
    shapes["a.weight"] = (32, 64)
    with pytest.raises(IntegrityError, match="a.weight has shape"):
        unpack_version(buckets, shapes)
    with pytest.raises(IntegrityError, match="missing"):
        unpack_version(buckets, {**shapes, "d": (1,)})
