"""rank_zoo over the tiny zoo: one forward pass a model, scores equal to scoring the
extracted arrays directly, cache reuse, clear errors."""

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


def test_rank_zoo_rejects_options_for_unrequested_metric(tiny_zoo, tiny_npz):
    with pytest.raises(MetricError, match="not requested"):
        rank_zoo(load_zoo(tiny_zoo), load_dataset(tiny_npz), ["leep"], metric_options={"knn": {}})
