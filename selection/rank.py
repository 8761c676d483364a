"""Rank a zoo for a dataset, and judge a ranking against ground truth.

``rank_zoo`` does one forward pass per model (cached on disk when asked) and scores it with
every requested metric from those same outputs, timing both. The evaluation helpers compare a
metric's scores with fine-tuned accuracies the way the transferability literature does
(weighted Kendall tau of LogME/SFDA, relative accuracy of the top-k picks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from zoopick.selection.metrics import registry
from zoopick.selection.ties import tie_groups

Progress = Callable[[str, int, int], None]
"""``progress(model_id, done, total)`` is called after each model."""


@dataclass
class ModelResult:
    id: str
    scores: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    # components of zoo-normalised metrics (NCTI), combined across the zoo by rank_zoo
    parts: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "scores": dict(self.scores), "seconds": dict(self.seconds)}


@dataclass
class Ranking:
    dataset: str
    metrics: list[str]
    models: list[ModelResult]
    # models left out, with why (a metric could not score them: a collapsed model, a head too
    # large for a metric); the service settles a failed model the same way
    errors: dict[str, str] = field(default_factory=dict)

    def ordered(self, metric: str) -> list[list[ModelResult]]:
        """Models best first by ``metric``, as groups of equal score (a group of several
        models is a tie: the metric cannot tell them apart)."""
        return [
            [self.models[i] for i in group]
            for group in tie_groups([m.scores[metric] for m in self.models])
        ]

    def best(self, metric: str) -> list[str]:
        """Ids of the top model(s) by ``metric``; several when they tie."""
        return [m.id for m in self.ordered(metric)[0]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "metrics": list(self.metrics),
            "models": [m.to_dict() for m in self.models],
            "errors": dict(self.errors),
        }


def check_metrics(metrics: Sequence[str]) -> list[str]:
    """Validate metric names up front (before any forward pass) and drop duplicates."""
    if not metrics:
        raise registry.MetricError("no metric given")
    for name in metrics:
        registry.get(name)
    return list(dict.fromkeys(metrics))


def score_model(
    entry: Any,
    dataset: Any,
    metrics: Sequence[str],
    *,
    cache_dir: str | Path | None = None,
    batch_size: int = 64,
    device: str | None = None,
    metric_options: Mapping[str, Mapping[str, Any]] | None = None,
    max_logits_bytes: int | None = None,
    preprocess_cache_bytes: int | None = None,
    shared_cache: Any = None,
) -> ModelResult:
    """One forward pass of the zoo model ``entry`` over ``dataset`` (cached on disk when
    ``cache_dir`` is given), then every metric from those outputs, each timed.

    ``metric_options`` maps a metric name to its keyword options; ``max_logits_bytes`` and
    ``preprocess_cache_bytes`` bound the extraction, ``shared_cache`` stands behind
    ``cache_dir`` (``extract``'s). A metric error is raised
    naming model and metric, never hidden behind a placeholder score. This is what a service
    worker calls per model; :func:`rank_zoo` calls it for each model of a zoo."""
    from zoopick.selection.extract import extract  # torch-heavy; imported when scoring

    metrics = check_metrics(metrics)
    options = _check_options(metrics, metric_options)
    out = extract(
        entry,
        dataset,
        batch_size=batch_size,
        device=device,
        cache_dir=cache_dir,
        max_logits_bytes=max_logits_bytes,
        preprocess_cache_bytes=preprocess_cache_bytes,
        shared_cache=shared_cache,
    )
    result = ModelResult(entry.id, cached=out.cached)
    result.seconds["forward"] = out.seconds
    for name in metrics:
        start = time.perf_counter()
        try:
            result.scores[name] = registry.score(
                name,
                labels=dataset.labels,
                logits=out.logits,
                features=out.features,
                **options.get(name, {}),
            )
            if registry.get(name).parts is not None:
                result.parts[name] = registry.score_parts(
                    name, labels=dataset.labels, logits=out.logits, features=out.features
                )
        except registry.MetricError as exc:
            raise registry.MetricError(f"model {entry.id!r}, metric {name!r}: {exc}") from exc
        result.seconds[name] = time.perf_counter() - start
    return result


def combine_zoo(models: Sequence[ModelResult], metrics: Sequence[str]) -> None:
    """Replace, in place, the single-model scores of zoo-normalised metrics (those registered
    with ``zoo_combine``, e.g. NCTI) by the scores their paper defines over the whole zoo,
    computed from every model's parts. Needs at least two models; one model keeps its
    single-model score."""
    if len(models) < 2:
        return
    for name in metrics:
        spec = registry.get(name)
        if spec.zoo_combine is None:
            continue
        combined = spec.zoo_combine({m.id: m.parts[name] for m in models})
        for m in models:
            m.scores[name] = combined[m.id]


def _check_options(
    metrics: Sequence[str], metric_options: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, Mapping[str, Any]]:
    options = dict(metric_options or {})
    unknown = set(options) - set(metrics)
    if unknown:
        raise registry.MetricError(f"options given for metrics not requested: {sorted(unknown)}")
    return options


def rank_zoo(
    zoo: Any,
    dataset: Any,
    metrics: Sequence[str],
    *,
    cache_dir: str | Path | None = None,
    batch_size: int = 64,
    device: str | None = None,
    metric_options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: Progress | None = None,
    max_logits_bytes: int | None = None,
    preprocess_cache_bytes: int | None = None,
) -> Ranking:
    """Score every model of ``zoo`` on ``dataset`` with each metric (:func:`score_model`, one
    forward pass a model), then apply zoo-level normalisations (:func:`combine_zoo`). Bad
    metric names or options are rejected before any forward pass. A model a metric cannot
    score is left out of the ranking with its error (``Ranking.errors``); when no model could
    be scored, the :class:`MetricError` names every model's."""
    metrics = check_metrics(metrics)
    _check_options(metrics, metric_options)
    entries = list(zoo)
    results: list[ModelResult] = []
    errors: dict[str, str] = {}
    for done, entry in enumerate(entries, start=1):
        try:
            results.append(
                score_model(
                    entry,
                    dataset,
                    metrics,
                    cache_dir=cache_dir,
                    batch_size=batch_size,
                    device=device,
                    metric_options=metric_options,
                    max_logits_bytes=max_logits_bytes,
                    preprocess_cache_bytes=preprocess_cache_bytes,
                )
            )
        except registry.MetricError as exc:
            errors[entry.id] = str(exc)
        if progress is not None:
            progress(entry.id, done, len(entries))
    if entries and not results:
        raise registry.MetricError("no model could be scored: " + "; ".join(errors.values()))
    combine_zoo(results, metrics)
    return Ranking(dataset=dataset.name, metrics=metrics, models=results, errors=errors)


def _aligned(scores: Mapping[str, float], truth: Mapping[str, float]) -> tuple[np.ndarray, ...]:
    missing = set(scores) ^ set(truth)
    if missing:
        raise ValueError(f"scores and ground truth cover different models: {sorted(missing)}")
    if len(scores) < 2:
        raise ValueError("need at least two models to evaluate a ranking")
    ids = sorted(scores)
    return (
        np.array([scores[i] for i in ids], dtype=np.float64),
        np.array([truth[i] for i in ids], dtype=np.float64),
    )


def rel_at_k(scores: Mapping[str, float], truth: Mapping[str, float], k: int) -> float:
    """Best ground-truth accuracy among the top-``k`` scored models over the best overall.

    Ties at the cut are resolved pessimistically (the worst of the tied models counts), so a
    metric that cannot tell models apart earns no credit for a lucky order.
    """
    s, t = _aligned(scores, truth)
    best = t.max()
    if best <= 0:
        raise ValueError("rel@k needs a positive best ground-truth value")
    picked: list[int] = []
    for group in tie_groups(list(s)):
        room = k - len(picked)
        if room <= 0:
            break
        if len(group) <= room:
            picked.extend(group)
        else:  # a tie straddles the cut: take the worst members
            picked.extend(sorted(group, key=lambda i: t[i])[:room])
    return float(t[picked].max() / best)


def evaluate(scores: Mapping[str, float], truth: Mapping[str, float]) -> dict[str, float]:
    """Rank correlation and top-k quality of ``scores`` against ground-truth accuracies.

    A correlation is NaN where it is undefined: every score tied (a metric that tells no
    model apart) or every accuracy equal; callers that average over targets must say how
    they count such a cell. ``rel@k`` stays defined (a tie at the cut counts its worst)."""
    s, t = _aligned(scores, truth)
    with np.errstate(invalid="ignore", divide="ignore"):
        wtau = stats.weightedtau(s, t).statistic
        ktau = stats.kendalltau(s, t).statistic
        pear = stats.pearsonr(s, t).statistic if np.ptp(s) > 0 and np.ptp(t) > 0 else np.nan
    return {
        "weighted_tau": float(wtau),
        "kendall_tau": float(ktau),
        "pearson": float(pear),
        "rel@1": rel_at_k(scores, truth, 1),
        "rel@3": rel_at_k(scores, truth, 3),
    }
