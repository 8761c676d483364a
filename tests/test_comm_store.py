"""Bucket layouts and the per-parameter store: residuals follow parameters across a bucket
rebuild."""

from __future__ import annotations

import torch

from zoopick.training.comm import SimpleBucket
from zoopick.training.comm.store import BucketLayout, ParamStore


def test_layout_offsets_from_gradient_views():
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)]
    layout = BucketLayout.of(SimpleBucket(params))
    assert layout.offsets == (0, 6, 10)
    assert layout.lengths == (6, 4, 1)
    assert layout.numel == 11


class _NonViewBucket(SimpleBucket):
    def gradients(self):
        return [g.clone() for g in super().gradients()]


def test_layout_falls_back_to_consecutive_offsets():
    params = [torch.zeros(3), torch.zeros(5)]
    assert BucketLayout.of(_NonViewBucket(params)).offsets == (0, 3)


def test_store_survives_a_rebuild_with_different_bucket_membership():
    a, b, c = torch.zeros(3), torch.zeros(2), torch.zeros(4)
    store = ParamStore()
    first = BucketLayout.of(SimpleBucket([a, b]))
    store.scatter(first, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    # rebuilt: c and a now share a bucket, b alone
    second = BucketLayout.of(SimpleBucket([c, a]))
    got = store.gather(second, torch.device("cpu"))
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    alone = BucketLayout.of(SimpleBucket([b]))
    assert store.gather(alone, torch.device("cpu")).tolist() == [4.0, 5.0]
    assert store.get(a).tolist() == [1.0, 2.0, 3.0]
    assert store.get(c) is None
    assert len(store) == 2


def test_simple_bucket_lays_out_gradients_like_ddp():
    params = [torch.zeros(2, 2), torch.zeros(3)]
    bucket = SimpleBucket(params, [torch.ones(2, 2), torch.full((3,), 2.0)], index=4, is_last=False)
    assert bucket.buffer().tolist() == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert bucket.index() == 4 and not bucket.is_last()
    bucket.gradients()[1].fill_(7.0)
    assert bucket.buffer()[4:].tolist() == [7.0, 7.0, 7.0]


def test_gather_hands_back_the_persistent_flat_residual():
    a, b = torch.zeros(3), torch.zeros(2)
    store = ParamStore()
    layout = BucketLayout.of(SimpleBucket([a, b]))
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    store.scatter(layout, flat)
    assert store.gather(layout, torch.device("cpu")) is flat  # no allocation, no copy
    # another layout overwrote b's entry: assembled afresh, with the current values
    store.scatter(BucketLayout.of(SimpleBucket([b])), torch.tensor([9.0, 8.0]))
    got = store.gather(layout, torch.device("cpu"))
    assert got is not flat and got.tolist() == [1.0, 2.0, 3.0, 9.0, 8.0]
