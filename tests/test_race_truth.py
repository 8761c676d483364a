"""The race benchmark's ground truth for a suite zoo (``benchmarks/race/truth.py``): read from
the runs the suite logged, with the suite's protocol, never fine-tuned; refused while a run is
missing. On a hand-made zoo folder and run log (no model is built or trained)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.race import truth
from benchmarks.transfer import ground_truth
from benchmarks.transfer.suite import FULL


@pytest.fixture
def zoo(tmp_path):
    """Two models without weights and one target; a run log with every run of the suite's
    protocol: seed 0 at each lr, seeds 1 and 2 at the best of seed 0."""
    root = tmp_path / "fonts"
    (root / "targets").mkdir(parents=True)
    models = [{"id": m, "arch": "test_resnet", "weights": "none"} for m in ("a", "b")]
    (root / "zoo.json").write_text(json.dumps({"models": models}))
    for split in ("train", "test"):
        np.savez(root / "targets" / f"t-{split}.npz", x=np.zeros((4, 8, 8)), y=np.arange(4) % 2)
    seed0 = {"a": {1e-3: 0.5, 3e-3: 0.7, 1e-2: 0.6}, "b": {1e-3: 0.4, 3e-3: 0.3, 1e-2: 0.2}}
    extra = {"a": (3e-3, [0.8, 0.9]), "b": (1e-3, [0.5, 0.6])}
    runner = ground_truth.Runner(root, {"epochs": FULL.epochs, "batch_size": 32}, 1, "cpu")
    lines = []
    for e in models:
        runs = [(lr, 0, acc) for lr, acc in seed0[e["id"]].items()]
        lr, accs = extra[e["id"]]
        runs += [(lr, s, acc) for s, acc in enumerate(accs, start=1)]
        for lr, s, acc in runs:
            key = runner.key(e, "t", lr, s)
            lines.append({"key": key, "target": "t", "model": e["id"], "lr": lr, "seed": s,
                          "acc": acc, "seconds": 1.0})  # fmt: skip
    log = root / "gt_runs.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_the_suites_truth_is_read_from_its_runs_at_the_best_lr(zoo):
    got = truth.field_truth(zoo, ["t"])
    # a: best lr 3e-3 (0.7 on seed 0), truth the mean of its three seeds there
    assert got["t"]["a"]["acc"] == pytest.approx((0.7 + 0.8 + 0.9) / 3)
    assert got["t"]["b"]["acc"] == pytest.approx((0.4 + 0.5 + 0.6) / 3)
    assert got["t"]["a"]["best_lr"] == "0.003"
    assert truth.zoo_name(zoo) == "fonts" and truth.role("fonts") == "held out"
    assert truth.role("base") == "development" and truth.role("other") == "not registered"


def test_a_zoo_whose_truth_is_incomplete_is_refused(zoo):
    log = zoo / "gt_runs.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:-1]) + "\n")  # b's seed 2 is still being computed
    with pytest.raises(
        SystemExit, match="1 of the suite.s fine-tuning runs .* t/b seed 2 at its best lr"
    ):
        truth.field_truth(zoo, ["t"])


def test_a_run_being_appended_to_the_log_is_not_read_yet(zoo):
    """A race reads the log while the suite appends the next cell's runs to it."""
    log = zoo / "gt_runs.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"key": "x", "target": "t2", "acc"')  # a line half written
    assert truth.field_truth(zoo, ["t"])["t"]["a"]["acc"] == pytest.approx(0.8)
    lines = whole.splitlines()
    log.write_text("\n".join([lines[0], '{"key": "x", "acc"', *lines[1:]]) + "\n")
    with pytest.raises(json.JSONDecodeError):  # a broken line inside the log is not skipped
        truth.field_truth(zoo, ["t"])


def _race_doc(targets: dict[str, float], **changes) -> dict:
    """A race result as run.py writes it: per target the metric's rel@1 and one race."""
    doc = {
        "zoo": "fonts",
        "role": "held out",
        "truth": "t",
        "protocol": {"select_by": "fsms", "shortlists": [3]},
        "service": "accuracy+cosine",
        "metric_code": "m",
        "models": 2,
        "seconds": 10.0,
        "targets": {
            t: {
                "metric_only": {"rel@1": rel},
                "ceiling_wtau": 0.8,
                "races": [
                    {
                        "variant": "service",
                        "k": 3,
                        "budget": 0.2,
                        "every_model": False,
                        "rel@1": 1.0,
                        "shortlist_best_rel": 1.0,
                        "compute": 0.2,
                        "race_wtau": 0.4,
                    },
                ],  # fmt: skip
            }
            for t, rel in targets.items()
        },
    }
    return {**doc, **changes}


def test_merged_races_keep_every_target_and_summarise_them_all():
    from benchmarks.race.run import merged

    old, new = _race_doc({"a": 0.9, "b": 0.5}), _race_doc({"b": 0.7, "c": 1.0})
    doc = merged(old, new)
    assert sorted(doc["targets"]) == ["a", "b", "c"]
    assert doc["targets"]["b"]["metric_only"]["rel@1"] == 0.7  # the newer run of b
    assert doc["seconds"] == 20.0
    metric = doc["summary"][0]
    assert metric["targets"] == 3
    assert metric["mean_rel@1"] == pytest.approx((0.9 + 0.7 + 1.0) / 3)
    assert metric["at_0.99"] == 1
    race = doc["summary"][1]
    assert race["targets"] == 3 and race["better_than_metric"] == 2


@pytest.mark.parametrize(
    "change",
    [
        {"protocol": {"select_by": "logme", "shortlists": [3]}},
        {"metric_code": "other"},
        {"zoo": "synth"},
    ],
)
def test_races_of_another_protocol_zoo_or_metric_code_are_not_merged(change):
    from benchmarks.race.run import merged

    with pytest.raises(SystemExit, match="differs in"):
        merged(_race_doc({"a": 0.9}), _race_doc({"b": 0.7}, **change))
