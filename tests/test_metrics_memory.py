"""Every metric's memory is bounded at the most classes a dataset may have (issue 10, item 3).

Validation caps a dataset at ``ZOOPICK_DATASET_MAX_CLASSES`` = 2,000 classes with at least
``ZOOPICK_DATASET_MIN_PER_CLASS`` = 2 images each. At that size (n = 4,000) every registered
metric must score within **512 MiB of peak traced allocation** (tracemalloc traces numpy's
buffers). Before the fix I-SMS alone allocated 1.7 GB here (its batched solve built a
C x d x C right-hand side). Feature and logit widths are small (the budget is about C); the two
slowest metrics run with cheaper options that keep their C x C and n x C structures
(N-LEEP: 3 EM iterations; SMS+ and FSMS: 8 dimensions, FSMS's pairwise cost being
C^2 dim^3 per half split, and 2 splits, which run one after another and so do not change the
peak), so the file stays well under a minute.
"""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest

from zoopick.selection import metrics

CLASSES = 2000
PER_CLASS = 2
BUDGET = 512 * 2**20
CHEAPER = {"nleep": {"max_iter": 3}, "sms+": {"dim": 8}, "fsms": {"dim": 8, "splits": 2}}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    n = CLASSES * PER_CLASS
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    centres = rng.normal(size=(CLASSES, 16))
    features = (centres[labels] + 0.5 * rng.normal(size=(n, 16))).astype(np.float32)
    logits = (features @ rng.normal(size=(16, 30))).astype(np.float32)
    return {"labels": labels, "features": features, "logits": logits}


@pytest.mark.parametrize("name", metrics.available())
def test_metric_memory_is_bounded_at_the_class_limit(inputs, name):
    kw = {"labels": inputs["labels"]}
    for need in metrics.needs(name):
        kw[need] = inputs[need]
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = metrics.score(name, **kw, **CHEAPER.get(name, {}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.isfinite(value)
    assert peak < BUDGET, f"{name}: peak {peak / 2**20:.0f} MiB over {BUDGET / 2**20:.0f} MiB"
