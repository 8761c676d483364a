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


def test_layout_cache_hands_back_the_layout_of_a_bucket_seen_before():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    cache: dict = {}
    bucket = SimpleBucket(params)
    first = BucketLayout.of(bucket, cache)
    assert BucketLayout.of(bucket, cache) is first  # no gradient views read again
    assert first == BucketLayout.of(bucket)  # what the uncached path finds
    other = BucketLayout.of(SimpleBucket(params[:1]), cache)  # other parameters: a miss
    assert other is not first and other.lengths == (6,)
    assert len(cache) == 2


def test_scattering_the_gathered_flat_keeps_in_place_updates():
    a, b = torch.zeros(3), torch.zeros(2)
    store = ParamStore()
    layout = BucketLayout.of(SimpleBucket([a, b]))
    store.scatter(layout, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    flat = store.gather(layout, torch.device("cpu"))
    flat.mul_(2.0)
    store.scatter(layout, flat)
    assert store.get(a).tolist() == [2.0, 4.0, 6.0] and store.get(b).tolist() == [8.0, 10.0]


def test_store_matches_a_plain_dict_over_random_rebuilds():
    """Random bucket memberships (DDP rebuilds), each step gathering a bucket, updating it in
    place or replacing it, and scattering it back, against a dict of per-parameter values."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(int(n)) for n in torch.randint(1, 5, (7,), generator=gen)]
    store, ref = ParamStore(), {}
    cpu = torch.device("cpu")
    for step in range(300):
        order = torch.randperm(len(params), generator=gen).tolist()
        cut = int(torch.randint(1, len(params), (1,), generator=gen))
        for members in (order[:cut], order[cut:]):
            for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
                bucket_params = [params[i] for i in members]
                layout = BucketLayout.of(SimpleBucket(bucket_params))
                got = store.gather(layout, cpu)
                want = torch.cat([ref.get(i, torch.zeros(params[i].numel())) for i in members])
                assert torch.equal(got, want), step
                delta = torch.randn(got.numel(), generator=gen)
                new = got.add_(delta) if step % 3 else got + delta  # in place or a new tensor
                store.scatter(layout, new)
                off = 0
                for i in members:
                    n = params[i].numel()
                    ref[i] = new[off : off + n].clone()
                    off += n
    for i, p in enumerate(params):
        assert torch.equal(store.get(p), ref[i])
