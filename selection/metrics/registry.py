"""The metric registry: every transferability metric registers itself here by name.

A metric is a plain function ``fn(*, labels, logits=None, features=None, **options) -> float``
(higher = better transfer). The registry records which inputs each one needs, so the ranking code
can decide what to extract and the CLI can reject a metric whose inputs are missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

INPUTS = frozenset({"logits", "features"})

MetricFn = Callable[..., float]


class MetricError(ValueError):
    """A metric cannot be computed on these inputs (bad shapes, too few samples, numerical
    failure). Raised instead of returning a sentinel score."""


PartsFn = Callable[[np.ndarray, np.ndarray], tuple[float, ...]]
ZooCombineFn = Callable[[Mapping[str, Sequence[float]]], dict[str, float]]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    fn: MetricFn
    needs: frozenset[str]
    summary: str
    # A metric the paper normalises across the models of a zoo (NCTI): ``parts(labels,
    # features)`` gives one model's components, ``zoo_combine({id: parts})`` the zoo's scores.
    # ``rank_zoo`` applies them; ``fn`` is the single-model stand-in.
    parts: PartsFn | None = None
    zoo_combine: ZooCombineFn | None = None

    @property
    def options(self) -> list[str]:
        """Keyword options the metric accepts beyond its inputs."""
        skip = {"labels", "logits", "features"}
        return [p for p in inspect.signature(self.fn).parameters if p not in skip]


_REGISTRY: dict[str, MetricSpec] = {}


def register(
    name: str,
    *,
    needs: set[str] | frozenset[str],
    parts: PartsFn | None = None,
    zoo_combine: ZooCombineFn | None = None,
) -> Callable[[MetricFn], MetricFn]:
    """Decorator: register ``fn`` as metric ``name`` needing the given inputs (``parts`` and
    ``zoo_combine``, together, for a metric normalised across a zoo; see :class:`MetricSpec`)."""
    needs = frozenset(needs)
    if not needs <= INPUTS or not needs:
        raise ValueError(f"metric {name!r}: needs must be a non-empty subset of {sorted(INPUTS)}")
    if (parts is None) != (zoo_combine is None):
        raise ValueError(f"metric {name!r}: parts and zoo_combine go together")

    def deco(fn: MetricFn) -> MetricFn:
        if name in _REGISTRY:
            raise ValueError(f"metric {name!r} registered twice")
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        _REGISTRY[name] = MetricSpec(
            name, fn, needs, doc[0] if doc else "", parts=parts, zoo_combine=zoo_combine
        )
        return fn

    return deco


def get(name: str) -> MetricSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MetricError(
            f"unknown metric {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def available() -> list[str]:
    return sorted(_REGISTRY)


def needs(name: str) -> frozenset[str]:
    """Which inputs (``logits`` and/or ``features``) metric ``name`` needs."""
    return get(name).needs


def _as_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise MetricError(f"labels must be a 1-D int array, got shape {y.shape}")
    if y.size == 0:
        raise MetricError("labels are empty")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
            y = y.astype(np.int64)
        else:
            raise MetricError(f"labels must be integers, got dtype {y.dtype}")
    if y.min() < 0:
        raise MetricError("labels must be non-negative")
    return y.astype(np.int64, copy=False)


COLLAPSED_RTOL = 1e-12
"""A feature column whose range is at most this fraction of its magnitude holds one value up
to rounding (float32 features differ by at least 6e-8 of it, so nothing real is this close)."""


def _as_matrix(name: str, x: np.ndarray, n: int) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged rows
        raise MetricError(f"{name} is not a numeric matrix: {exc}") from None
    if a.ndim != 2:
        raise MetricError(f"{name} must be a 2-D array (n, dim), got shape {a.shape}")
    if a.shape[0] != n:
        raise MetricError(f"{name} has {a.shape[0]} rows but labels has {n}")
    if a.shape[1] == 0:
        raise MetricError(f"{name} has no columns (shape {a.shape})")
    if not (np.issubdtype(a.dtype, np.number) and not np.iscomplexobj(a)):
        raise MetricError(f"{name} must hold real numbers, got dtype {a.dtype}")
    if not np.all(np.isfinite(a)):
        raise MetricError(f"{name} contains NaN or infinite values")
    a = a.astype(np.float64, copy=False)
    if name == "features" and _collapsed(a):
        raise MetricError(
            "features are the same for every image (up to rounding): a collapsed model, "
            "which no metric can rank"
        )
    return a


def _collapsed(a: np.ndarray) -> bool:
    """Every column one value up to rounding (:data:`COLLAPSED_RTOL`). Centring such columns
    leaves rounding noise of about 1e-16 of their value, which scale-free metrics (SFDA,
    H-score, PARC's standardisation) read as signal: a collapsed model scored SFDA's best."""
    span = a.max(axis=0) - a.min(axis=0)
    size = np.abs(a).max(axis=0)
    return bool(np.all(span <= COLLAPSED_RTOL * size))


def score(
    name: str,
    *,
    labels: np.ndarray,
    logits: np.ndarray | None = None,
    features: np.ndarray | None = None,
    **options: object,
) -> float:
    """Score one model with metric ``name``: higher means better expected transfer.

    ``labels``: int array (n,); ``logits``: raw source-head outputs (n, C_s); ``features``:
    penultimate features (n, D). Inputs are validated here once so every metric can assume
    clean float64 matrices with matching rows and int64 labels.
    """
    spec = get(name)
    y = _as_labels(labels)
    inputs: dict[str, np.ndarray] = {}
    for key, value in (("logits", logits), ("features", features)):
        if key in spec.needs:
            if value is None:
                raise MetricError(f"metric {name!r} needs {key}")
            inputs[key] = _as_matrix(key, value, y.shape[0])
    unknown = set(options) - set(spec.options)
    if unknown:
        raise MetricError(
            f"metric {name!r} has no option(s) {sorted(unknown)}; it takes {spec.options}"
        )
    value = float(spec.fn(labels=y, **inputs, **options))
    if not np.isfinite(value):
        raise MetricError(f"metric {name!r} produced a non-finite score ({value})")
    return value


def score_parts(
    name: str,
    *,
    labels: np.ndarray,
    logits: np.ndarray | None = None,
    features: np.ndarray | None = None,
) -> tuple[float, ...]:
    """One model's components of a zoo-normalised metric (``spec.parts``), inputs validated as
    :func:`score` does. :class:`MetricError` for a metric without parts."""
    spec = get(name)
    if spec.parts is None:
        raise MetricError(f"metric {name!r} is not normalised across a zoo (it has no parts)")
    y = _as_labels(labels)
    inputs = {"logits": logits, "features": features}
    args = []
    for key in sorted(spec.needs):
        if inputs[key] is None:
            raise MetricError(f"metric {name!r} needs {key}")
        args.append(_as_matrix(key, inputs[key], y.shape[0]))
    values = tuple(float(v) for v in spec.parts(y, *args))
    if not all(np.isfinite(values)):
        raise MetricError(f"metric {name!r} produced non-finite components {values}")
    return values
