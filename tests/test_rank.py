"""rank_zoo over the tiny zoo: one forward pass a model, scores equal to scoring the
extracted arrays directly, cache reuse, clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zoopick.selection as selection
from zoopick.selection.data import load_dataset
from zoopick.selection.extract import extract
from zoopick.selection.metrics import MetricError
from zoopick.selection.rank import ModelResult, Ranking, rank_zoo
from zoopick.selection.zoo import load_zoo


def test_rank_zoo_scores_match_direct_scoring(tiny_zoo, tiny_npz, tmp_path):
    zoo, data = load_zoo(tiny_zoo), load_dataset(tiny_npz)
    seen = []
    ranking = rank_zoo(
        zoo, data, ["leep", "logme"], cache_dir=tmp_path / "c", progress=lambda *a: seen.append(a)
    )
    assert [m.id for m in ranking.models] == zoo.ids
    assert seen[-1][1:] == (len(zoo), len(zoo))
    for entry, result in zip(zoo, ranking.models, strict=True):
        out = extract(entry, data, cache_dir=tmp_path / "c")
        assert out.cached  # the ranking filled the cache
        assert result.scores["leep"] == pytest.approx(
            selection.score("leep", labels=data.labels, logits=out.logits)
        )
        assert result.scores["logme"] == pytest.approx(
            selection.score("logme", labels=data.labels, features=out.features)
        )
        assert set(result.seconds) == {"forward", "leep", "logme"}
    again = rank_zoo(zoo, data, ["leep"], cache_dir=tmp_path / "c")
    assert all(m.cached and m.seconds["forward"] == 0.0 for m in again.models)
    d = ranking.to_dict()
    assert d["metrics"] == ["leep", "logme"] and len(d["models"]) == len(zoo)


def test_ordered_reports_ties():
    r = Ranking(
        "d",
        ["m"],
        [ModelResult("a", {"m": 0.5}), ModelResult("b", {"m": 0.9}), ModelResult("c", {"m": 0.5})],
    )
    assert [[m.id for m in g] for g in r.ordered("m")] == [["b"], ["a", "c"]]
    assert r.best("m") == ["b"]


def test_rank_zoo_rejects_unknown_metric_before_any_forward(tiny_zoo, tiny_npz):
    with pytest.raises(MetricError, match="unknown metric 'nope'"):
        rank_zoo(load_zoo(tiny_zoo), load_dataset(tiny_npz), ["leep", "nope"])


def test_rank_zoo_names_model_on_metric_failure(tiny_zoo, tmp_path):
    # two images, two classes: LEEP needs more samples than classes, and says which model
    np.savez(tmp_path / "two.npz", x=np.zeros((2, 16, 16), np.uint8), y=np.array([0, 1]))
    data = load_dataset(tmp_path / "two.npz")
    with pytest.raises(MetricError, match="model 'tiny-resnet', metric 'leep'"):
        rank_zoo(load_zoo(tiny_zoo), data, ["leep"])


def wide_head_zoo(tiny_zoo) -> Path:
    """The tiny zoo plus a random test_resnet with 4,097 outputs: one more than plain SMS
    fits full covariances over, so SMS cannot score that model (and only that one)."""
    manifest = json.loads(tiny_zoo.read_text())
    manifest["models"].append(
        {"id": "wide-head", "arch": "test_resnet", "weights": "none", "num_classes": 4097,
         "input_size": [3, 32, 32]}
    )  # fmt: skip
    path = tiny_zoo.with_name("wide.json")
    path.write_text(json.dumps(manifest))
    return path


def test_a_model_a_metric_cannot_score_is_left_out_naming_why(tiny_zoo, tiny_npz, tmp_path):
    zoo, data = load_zoo(wide_head_zoo(tiny_zoo)), load_dataset(tiny_npz)
    ranking = rank_zoo(zoo, data, ["leep", "sms"], cache_dir=tmp_path / "c")
    assert [m.id for m in ranking.models] == [i for i in zoo.ids if i != "wide-head"]
    assert list(ranking.errors) == ["wide-head"]
    assert "model 'wide-head', metric 'sms'" in ranking.errors["wide-head"]
    assert ranking.to_dict()["errors"] == ranking.errors
    # the command line ranks the rest, says which model it left out, and exits 0
    r = subprocess.run(
        [sys.executable, "-m", "zoopick.cli", "score", "--zoo", str(wide_head_zoo(tiny_zoo)),
         "--data", str(tiny_npz), "-m", "leep", "-m", "sms", "--cache-dir",
         str(tmp_path / "c"), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: model 'wide-head' left out" in r.stderr
    out = json.loads(r.stdout)
    assert list(out["errors"]) == ["wide-head"] and len(out["models"]) == len(zoo) - 1


def test_rank_zoo_rejects_options_for_unrequested_metric(tiny_zoo, tiny_npz):
    with pytest.raises(MetricError, match="not requested"):
        rank_zoo(load_zoo(tiny_zoo), load_dataset(tiny_npz), ["leep"], metric_options={"knn": {}})
