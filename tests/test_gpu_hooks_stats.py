"""The statistics of benchmarks/comm/gpu_hooks.py (issue 19's GPU verdicts): the paired
added time with its bootstrap interval, and the three-way verdict, on hand-made rounds."""

from __future__ import annotations

import statistics

from benchmarks.comm.gpu_hooks import paired, verdicts


def test_paired_median_of_round_differences_and_its_interval():
    noop = [30.0, 50.0, 40.0, 35.0, 45.0]  # drift shared by every hook in a round
    hook = [x + d for x, d in zip(noop, [2.0, 4.0, 3.0, 2.5, 3.5], strict=True)]
    med, lo, hi = paired(hook, noop)
    assert med == 3.0  # the median of the differences, not of the difference of medians
    assert 2.0 <= lo <= med <= hi <= 4.0  # a bootstrap median lies within the data's range
    # a constant cost under a drifting baseline is found exactly, with no spread at all
    drift = [30.0, 60.0, 35.0, 90.0, 40.0]
    assert paired([x + 3.0 for x in drift], drift) == (3.0, 3.0, 3.0)
    assert statistics.stdev(drift) > 20  # while the unpaired rounds spread by tens of ms


def _row(hook: str, rounds: list[float], noop: list[float], mb: float = 25.0) -> dict:
    med, lo, hi = paired(rounds, noop)
    return {"recipe": "resnet50", "hook": hook, "bucket_mb": mb, "round_ms": rounds,
            "added_ms": med, "added_lo_ms": lo, "added_hi_ms": hi}  # fmt: skip


def test_verdicts_met_not_met_and_undecided():
    noop = [40.0 + (i % 7) for i in range(30)]  # a drifting baseline
    dense = [x + 0.2 for x in noop]
    fast = [x + 0.5 + 0.1 * (i % 3) for i, x in enumerate(noop)]  # about +0.6 ms, tight
    slow = [x + 9.0 + (i % 3) for i, x in enumerate(noop)]  # about +10 ms
    noisy = [x + (1.5 if i % 2 else -1.0) * (i % 5) for i, x in enumerate(noop)]  # straddles
    rows = [_row("noop", noop, noop), _row("dense", dense, noop),
            _row("spardl", fast, noop), _row("gaussiank", slow, noop),
            _row("spardl+async", noisy, noop)]  # fmt: skip
    got = {v["hook"]: v["met"] for v in verdicts(rows)}
    assert got == {"spardl": "met", "gaussiank": "not met", "spardl+async": "undecided"}
    # over dense is limited too: a hook under 1.5 ms but more than dense + 1 ms is not met
    tight_dense = [x - 1.0 for x in noop]
    rows[1] = _row("dense", tight_dense, noop)
    assert {v["hook"]: v["met"] for v in verdicts(rows)}["spardl"] == "not met"
