"""What every registered metric does with inputs it cannot rank on: a clear ``MetricError``
from the registry, never a score read off rounding noise or a numpy exception (found by an
outside-style probe of the metrics, session 19)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from zoopick.selection.metrics import MetricError, available, needs, score
from zoopick.selection.metrics.sms import SMS_MAX_OUTPUTS

LABELS = np.arange(300) % 5
FEATURE_METRICS = [m for m in available() if "features" in needs(m)]


def inputs(metric: str, features: np.ndarray) -> dict:
    """``features`` as the input under test; logits, where the metric needs them too, fine."""
    out = {"labels": LABELS, "features": features}
    if "logits" in needs(metric):
        out["logits"] = np.random.default_rng(0).normal(size=(len(LABELS), 10))
    return out


@pytest.mark.parametrize("metric", FEATURE_METRICS)
@pytest.mark.parametrize(
    "collapsed",
    [np.full((300, 32), 0.1), np.zeros((300, 32)), np.full((300, 32), 0.1, np.float32)],
    ids=["constant-0.1", "zeros", "constant-float32"],
)
def test_a_collapsed_model_is_refused_by_every_feature_metric(metric, collapsed):
    # float64 0.1 centred leaves ~5e-16 of noise: SFDA scored it 1.0, its best, and H-score
    # ranked it over a weak but real model
    with pytest.raises(MetricError, match="collapsed"):
        score(metric, **inputs(metric, collapsed))


@pytest.mark.parametrize("metric", FEATURE_METRICS)
def test_one_informative_column_is_not_collapsed(metric):
    rng = np.random.default_rng(1)
    features = np.full((300, 8), 0.1)
    features[:, 3] = LABELS + rng.normal(0, 0.5, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            value = score(metric, **inputs(metric, features))
        except MetricError as exc:  # a metric may still need more than one dimension
            assert "collapsed" not in str(exc)
        else:
            assert np.isfinite(value)


@pytest.mark.parametrize("metric", available())
@pytest.mark.parametrize(
    "bad, needle",
    [
        (np.zeros((300, 0)), "no columns"),
        (np.full((300, 3), "a"), "real numbers"),
        (np.ones((300, 3), complex), "real numbers"),
    ],
    ids=["no-columns", "strings", "complex"],
)
def test_matrices_a_metric_cannot_read_are_metric_errors(metric, bad, needle):
    given = dict.fromkeys(needs(metric), bad)
    with pytest.raises(MetricError, match=needle):
        score(metric, labels=LABELS, **given)


def test_ragged_rows_are_a_metric_error():
    with pytest.raises(MetricError, match="numeric matrix"):
        score("knn", labels=np.array([0, 1]), features=[[1.0, 2.0], [1.0]])


def test_parc_checks_its_subsample_only_when_it_takes_one():
    rng = np.random.default_rng(2)
    labels = np.arange(3000) % 2600  # 2,600 classes: more than max_samples / 2
    assert np.isfinite(score("parc", labels=labels, features=rng.normal(size=(3000, 16))))
    with pytest.raises(MetricError, match="raise max_samples to at least 5200"):
        score("parc", labels=np.arange(6000) % 2600, features=rng.normal(size=(6000, 16)))
    with pytest.raises(MetricError, match="at least 2 feature dimensions"):
        score("parc", labels=LABELS, features=rng.normal(size=(300, 1)))


def test_sms_refuses_a_head_too_large_for_full_covariances():
    logits = np.zeros((10, SMS_MAX_OUTPUTS + 1), np.float32)  # refused before any work
    with pytest.raises(MetricError, match="isms and sms\\+"):
        score("sms", labels=np.arange(10) % 2, logits=logits)
