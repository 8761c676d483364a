"""What a race is judged against, and whether a zoo may be looked at.

The ground truth of a suite zoo is the field's (``benchmarks/transfer/ground_truth.compute``
with the suite's full protocol, ``suite.FULL``: Adam, cosine decay, 10 epochs, the best of three
learning rates, three seeds at the best), read from the fine-tuning runs the suite left in
``<zoo>/gt_runs.jsonl``. This module never fine-tunes: a zoo whose runs are not all there is
refused (its truth is still being computed, and a partial truth must not be looked at). A
truth file in ``ground_truth.py``'s format (``--ground-truth``) replaces it: the committed
truth of the first zoo, ``benchmarks/results/transfer_ground_truth.json``, whose reduced
protocol (3 epochs at lr 1e-2, three seeds) the first race was measured against.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.transfer import build_zoo, ground_truth

ROLES = {
    "base": "development",
    "fonts": "held out",
    "synth": "held out",
}
"""How each zoo may be used (``PREREGISTRATION.md``): the racing rule was chosen on ``base``;
``fonts`` and ``synth`` judge it, once, as registered."""


def zoo_name(root: Path) -> str:
    """The suite's name of the zoo at ``root`` (``base`` keeps its old folder)."""
    if root.resolve() == build_zoo.default_out("base").resolve():
        return "base"
    return root.name


def role(name: str) -> str:
    return ROLES.get(name, "not registered")


def from_file(path: Path, targets: list[str] | None) -> dict[str, dict]:
    truth = json.loads(path.read_text())
    return {t: truth[t] for t in (targets or list(truth))}


def field_truth(root: Path, targets: list[str], device: str = "cpu") -> dict[str, dict]:
    """The suite's field truth of ``targets`` from the runs cached in ``<zoo>/gt_runs.jsonl``
    (``ground_truth.compute`` with ``suite.FULL``); refuses, naming what is missing, unless
    every run is there, so it never trains."""
    from benchmarks.transfer.suite import FULL

    opts = {"epochs": FULL.epochs, "batch_size": 32}  # compute's keys: its default batch
    runner = ground_truth.Runner(root, opts, jobs=1, device=device)
    entries = ground_truth.read_manifest(root)
    missing = []
    for t in targets:
        for e in entries:
            for lr in FULL.lrs:
                for s in range(FULL.seeds):
                    if runner.key(e, t, lr, s) not in runner.done:
                        missing.append(f"{t}/{e['id']} lr {lr:g} seed {s}")
            for s in range(FULL.seeds, FULL.seeds + FULL.extra_seeds):
                if not any(runner.key(e, t, lr, s) in runner.done for lr in FULL.lrs):
                    missing.append(f"{t}/{e['id']} seed {s} at its best lr")
    if missing:
        raise SystemExit(
            f"{len(missing)} of the suite's fine-tuning runs for {root} are not in "
            f"{root / 'gt_runs.jsonl'} (first: {missing[0]}); its ground truth is not complete: "
            "run benchmarks/transfer/suite.py --truth-only for this zoo first"
        )
    truth, meta = ground_truth.compute(
        root,
        targets,
        lrs=list(FULL.lrs),
        epochs=FULL.epochs,
        seeds=FULL.seeds,
        extra_seeds=FULL.extra_seeds,
        jobs=1,
        device=device,
    )
    assert meta["runs_this_call"] == 0, "the race benchmark never fine-tunes ground truth"
    return truth
