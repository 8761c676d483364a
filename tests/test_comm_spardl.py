"""SparDL: the reduce-scatter schedule for any P, and real gloo runs at P = 3, 5, 6, 7.

The schedule tests are pure Python on ``spardl_schedule`` (the function the hook uses) and its
contributor simulation. The multi-process tests reuse the per-P launch of
``tests/test_comm_hooks.py`` (one launch per P for all hooks), which also runs SparDL with
teams (every divisor of P), fp16 and the power-of-two split.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import zoopick.training.comm as comm
from tests.comm_harness import launch_cached
from tests.test_comm_hooks import (
    DENSITY,
    ITERS,
    SHAPES,
    _raw,
    check_conservation,
    raw_configs,
    suite,
)
from zoopick.training.comm.spardl import simulate_schedule


# ------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("split", ["gap", "halving", "pow2"])
@pytest.mark.parametrize("P", list(range(1, 34)))
def test_schedule_gives_each_block_one_contribution_per_worker(P, split):
    rounds = comm.spardl_schedule(P, split)
    assert len(rounds) == math.ceil(math.log2(P)) if P > 1 else len(rounds) == 0
    hold = simulate_schedule(P, rounds)
    everyone = Counter(range(P))
    for w in range(P):
        assert set(hold[w]) == {w}, f"worker {w} ends holding blocks {sorted(hold[w])}"
        assert hold[w][w] == everyone
    sent = Counter()
    received = Counter()
    for rnd in rounds:
        peers = Counter()
        for tr in rnd:
            assert tr.src != tr.dst and tr.blocks
            sent[tr.src] += len(tr.blocks)
            received[tr.dst] += len(tr.blocks)
            peers[tr.src] += 1
        if split == "halving":
            assert max(peers.values()) <= 2  # at most two messages per worker and round
    for w in range(P):
        assert sent[w] == P - 1 and received[w] == P - 1


@pytest.mark.parametrize("P", list(range(2, 17)))
def test_gap_schedule_one_message_per_worker_per_round(P):
    """SparDL's schedule: ceil(log2 P) rounds, each worker sends one message to one peer and
    receives one per round, so the critical path is ceil(log2 P) message steps; round sizes
    P - 2^(R-1), 2^(R-2), ..., 1 blocks."""
    rounds = comm.spardl_schedule(P)
    R = math.ceil(math.log2(P))
    assert comm.message_steps(rounds) == R
    sizes = []
    for rnd in rounds:
        assert sorted(t.src for t in rnd) == list(range(P))
        assert sorted(t.dst for t in rnd) == list(range(P))
        assert len({len(t.blocks) for t in rnd}) == 1
        sizes.append(len(rnd[0].blocks))
    assert sizes == [P - 2 ** (R - 1)] + [2**e for e in range(R - 2, -1, -1)]


def test_message_steps_of_the_old_halving_split():
    """The figures that motivated the gap schedule (halving split, non-power-of-two P)."""
    steps = {P: comm.message_steps(comm.spardl_schedule(P, "halving")) for P in (3, 5, 7, 9, 11)}
    assert steps == {3: 3, 5: 5, 7: 5, 9: 7, 11: 7}


def test_gap_schedule_worked_example():
    got = [sorted((t.src, t.dst, t.blocks) for t in rnd) for rnd in comm.spardl_schedule(5)]
    assert got == [
        [(i, (i + 4) % 5, ((i + 4) % 5,)) for i in range(5)],
        sorted((i, (i + 2) % 5, ((i + 2) % 5, (i + 3) % 5)) for i in range(5)),
        sorted((i, (i + 1) % 5, ((i + 1) % 5,)) for i in range(5)),
    ]


def test_schedule_worked_examples_from_the_docstring():
    def fmt(P):
        return [
            sorted((t.src, t.dst, t.blocks) for t in rnd)
            for rnd in comm.spardl_schedule(P, "halving")
        ]

    assert fmt(3) == [
        [(0, 2, (2,)), (1, 2, (2,)), (2, 0, (0,)), (2, 1, (1,))],
        [(0, 1, (1,)), (1, 0, (0,))],
    ]
    assert fmt(5)[0] == [
        (0, 3, (3, 4)),
        (1, 3, (3,)),
        (1, 4, (4,)),
        (2, 4, (3, 4)),
        (3, 0, (0, 1)),
        (3, 1, (2,)),
        (4, 1, (0,)),
        (4, 2, (1, 2)),
    ]
    assert fmt(6)[0] == [
        (0, 3, (3, 4, 5)),
        (1, 4, (3, 4, 5)),
        (2, 5, (3, 4, 5)),
        (3, 0, (0, 1, 2)),
        (4, 1, (0, 1, 2)),
        (5, 2, (0, 1, 2)),
    ]
    assert [sorted((t.src, t.dst, t.blocks) for t in r) for r in comm.spardl_schedule(5, "pow2")][
        0
    ] == [(j, 4, (4,)) for j in range(4)] + [(4, j, (j,)) for j in range(4)]


def test_simulation_catches_a_broken_schedule():
    bad = ((comm.Transfer(0, 1, (1,)),), (comm.Transfer(0, 1, (1,)),))
    with pytest.raises(comm.CommError, match="lacks"):
        simulate_schedule(2, bad)
    hold = simulate_schedule(2, bad[:1])
    assert hold[0] == {0: Counter({0: 1})}  # worker 1 never sent block 0: contribution lost
    assert hold[1][1] == Counter({0: 1, 1: 1})


# --------------------------------------------------------------------------- real runs
def spardl_suite(rank: int, P: int) -> dict:
    """Only the SparDL raw-bucket runs (for P = 7, which the all-hooks suite does not cover)."""
    torch.manual_seed(rank)
    keys = [k for k in raw_configs(P) if k.startswith("spardl")]
    return {"rank": rank, "P": P, "raw": {k: _raw(rank, P, *raw_configs(P)[k]) for k in keys}}


@pytest.fixture(scope="module", params=[3, 5, 6, 7], ids=lambda p: f"P{p}")
def run(request):
    if request.param == 7:
        return launch_cached(spardl_suite, 7)
    return launch_cached(suite, request.param)


def _split_sizes(split):
    return [sum(math.prod(SHAPES[i]) for i in members) for members in split]


def _buckets(split, tensors):
    return [torch.cat([tensors[i] for i in members]) for members in split]


def _spardl_reference(
    accs: list[torch.Tensor], k: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """SparDL with one team, played in one process on float64 copies; every value sent is
    rounded to ``dtype`` and the rounding stays behind (error feedback)."""
    P = len(accs)
    n = accs[0].numel()
    bounds = [j * n // P for j in range(P + 1)]
    kb = math.ceil(k / P)
    W = [a.double().clone() for a in accs]

    def take(w: int, j: int) -> torch.Tensor:
        lo, hi = bounds[j], bounds[j + 1]
        out = torch.zeros(n, dtype=torch.float64)
        top = torch.argsort(-W[w][lo:hi].abs())[: min(kb, hi - lo)] + lo
        out[top] = W[w][top].to(dtype).double()
        W[w][top] -= out[top]
        return out

    for rnd in comm.spardl_schedule(P):
        msgs = [(tr.dst, sum(take(tr.src, j) for j in tr.blocks)) for tr in rnd]
        for dst, vec in msgs:
            W[dst] += vec
    return sum(take(w, w) for w in range(P))


def _reduced_and_accumulated(run, key: str, it: int):
    """Iteration ``it`` of hook ``key``: the averaged buckets every rank got, and per bucket
    each rank's accumulated gradient (its gradient plus the residual it carried in)."""
    recs = [res["raw"][key]["records"][it] for res in run]
    split = recs[0]["split"]
    accs = [
        _buckets(split, [g + b for g, b in zip(r["grads"], r["before"], strict=True)]) for r in recs
    ]
    return _buckets(split, recs[0]["avg"]), list(zip(*accs, strict=True))


@pytest.mark.parametrize("key", ["spardl", "spardl_device"])
def test_matches_plain_reference(run, key):
    """Both selection paths (the CPU's sampled one, the accelerator's batched block topk)
    give the reference's sums."""
    P = len(run)
    for it in range(ITERS):
        got, per_bucket = _reduced_and_accumulated(run, key, it)
        for b, per_rank in enumerate(per_bucket):
            k = math.ceil(DENSITY * per_rank[0].numel() - 1e-9)
            expect = _spardl_reference(list(per_rank), k)
            np.testing.assert_allclose(got[b].numpy(), expect.numpy() / P, atol=1e-5)


@pytest.mark.parametrize(
    ("key", "dtype"), [("spardl_p16", torch.float16), ("spardl_p16bf", torch.bfloat16)]
)
def test_sixteen_bit_pairs_match_the_rounded_reference(run, key, dtype):
    """``pairs16``: the same sums as the plain reference with every sent value rounded to
    the 16-bit type (up to that rounding where float32 and float64 partial sums round
    differently)."""
    P = len(run)
    eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    for it in range(ITERS):
        got, per_bucket = _reduced_and_accumulated(run, key, it)
        for b, per_rank in enumerate(per_bucket):
            k = math.ceil(DENSITY * per_rank[0].numel() - 1e-9)
            expect = _spardl_reference(list(per_rank), k, dtype).numpy() / P
            np.testing.assert_allclose(got[b].numpy(), expect, atol=2 * eps * abs(expect).max())
            assert np.array_equal(got[b].numpy() != 0, expect != 0)


def test_sixteen_bit_pairs_halve_the_bytes(run):
    """``pairs16``: 4 bytes a pair plus one 4-byte chunk count per block and message (every
    block here is under 65,536 elements). One team sends (P - 1) blocks of kb pairs in the
    reduce-scatter and its own block to P - 1 workers in the spread, and receives as much:
    half the 32-bit form's 8-byte pairs, plus the counts."""
    P = len(run)
    for key in ("spardl_p16", "spardl_p16bf"):
        for it in range(ITERS):
            kbs = [math.ceil(k / P) for k in _ks(run, key, it, DENSITY)]
            expect = sum(2 * (P - 1) * (4 * kb + 4) for kb in kbs)
            for res in run:
                rec = res["raw"][key]["stats"][it]
                assert rec["bytes_sent"] == rec["bytes_recv"] == expect, key
                full = res["raw"]["spardl"]["stats"][it]["bytes_sent"]
                assert rec["bytes_sent"] == full / 2 + 8 * (P - 1) * len(kbs)


def test_density_one_is_the_dense_average(run):
    keys = [k for k in raw_configs(len(run)) if k.startswith("spardl") and k.endswith("dense")]
    assert "spardl_dense" in keys
    for key in keys:
        for it in range(ITERS):
            recs = [res["raw"][key]["records"][it] for res in run]
            for i in range(len(SHAPES)):
                dense = sum(r["grads"][i] for r in recs) / len(run)
                torch.testing.assert_close(recs[0]["avg"][i], dense, rtol=1e-6, atol=1e-6)
                for r in recs:
                    assert torch.all(r["after"][i] == 0), key


def test_residual_conservation_all_variants(run):
    keys = [k for k in raw_configs(len(run)) if k.startswith("spardl")]
    assert len(keys) >= 6
    for key in keys:
        check_conservation(run, key)


def _ks(run, key: str, it: int, density: float) -> list[int]:
    sizes = _split_sizes(run[0]["raw"][key]["records"][it]["split"])
    return [math.ceil(density * n - 1e-9) for n in sizes]


@pytest.mark.parametrize("variant", ["", "_fp16"])
def test_bytes_per_worker_exact(run, variant):
    """Teams = d (t = P / d workers per team): (t - 1) blocks of kb = ceil(k / t) pairs in the
    reduce-scatter, (d - 1) shares of h pairs across teams (h = ceil(kb / d) at first, adapted
    within [ceil(kb / d), kb] afterwards), t - 1 blocks of kb in the spread; same received.
    Teams send fewer bytes than one team on the first iteration."""
    P = len(run)
    pair = 4 + (2 if variant else 4)
    one_team = {}
    for d in [d for d in range(1, P + 1) if P % d == 0]:
        key = ("spardl" if d == 1 else f"spardl_teams{d}") + variant
        t = P // d
        for it in range(ITERS):
            ks = _ks(run, key, it, DENSITY)
            kbs = [math.ceil(k / t) for k in ks]
            low = sum(2 * (t - 1) * kb + (d - 1) * math.ceil(kb / d) for kb in kbs) * pair
            high = sum(2 * (t - 1) * kb + (d - 1) * kb for kb in kbs) * pair
            for res in run:
                rec = res["raw"][key]["stats"][it]
                assert rec["bytes_sent"] == rec["bytes_recv"], key
                if it == 0 or d == 1:
                    assert rec["bytes_sent"] == low, key
                else:
                    assert low <= rec["bytes_sent"] <= high, key
                if d == 1:
                    one_team[it] = rec["bytes_sent"]
                elif it == 0:
                    assert rec["bytes_sent"] < one_team[0], key


def test_bytes_per_worker_close_to_two_k_pairs(run):
    """One team: 2 k (P - 1) / P (index, value) pairs each way, up to the rounding of
    k / P per block (no header: all message sizes are known in advance)."""
    P = len(run)
    for it in range(ITERS):
        ideal = sum(2 * k * (P - 1) / P for k in _ks(run, "spardl_d20", it, 0.2)) * 8
        for res in run:
            rec = res["raw"]["spardl_d20"]["stats"][it]
            # ceil(k / P) per block costs up to P - 1 pairs per bucket: 3.2 % at P = 7 here
            assert ideal <= rec["bytes_sent"] <= 1.05 * ideal
            assert ideal <= rec["bytes_recv"] <= 1.05 * ideal


def test_teams_apply_at_most_k_pairs_per_bucket(run):
    P = len(run)
    for d in [d for d in range(2, P + 1) if P % d == 0]:
        key = f"spardl_teams{d}"
        t = P // d
        for it in range(ITERS):
            recs = [res["raw"][key]["records"][it] for res in run]
            split = recs[0]["split"]
            for avg, n in zip(_buckets(split, recs[0]["avg"]), _split_sizes(split), strict=True):
                k = math.ceil(DENSITY * n - 1e-9)
                assert 0 < int((avg != 0).sum()) <= t * math.ceil(k / t)
