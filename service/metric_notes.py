"""What the dashboard says about metrics (the submit form, the job page): the registry's
list, each with one line on what it computes, and which requested metrics give the same score
on which models (the form offered free text, so a user had to know the names and what each
does). Here, in the core, as the dashboard reads no library itself.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping

from zoopick.selection import metrics

ISMS_DIM = 25
"""Outputs I-SMS projects a head to (``isms``'s default ``dim``, the one a job uses): a head
of this many outputs or fewer is not projected, so I-SMS is SMS exactly on it."""


def _plain(text: str) -> str:
    """A docstring's first line as plain text (no reST markup)."""
    return re.sub(r"``([^`]*)``|:\w+:`~?([^`]*)`", lambda m: m.group(1) or m.group(2), text)


CAVEATS = {
    "isms": f"the same score as sms on a head of {ISMS_DIM} outputs or fewer",
    "sms+": "grows with the head's size: not for zoos of mixed heads",
}
"""What a user must know before picking these (docs/metrics.md says more)."""


def summary(name: str) -> str:
    """``name``'s first sentence of its docstring (which may wrap over lines), plain."""
    paragraph = " ".join((inspect.getdoc(metrics.get(name).fn) or "").split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.)])\s+(?=[A-Z])", paragraph, maxsplit=1)[0]
    text = _plain(sentence).replace(" dim ", f" {ISMS_DIM} ").rstrip(".")
    return text + (f"; {CAVEATS[name]}." if name in CAVEATS else ".")


def choices() -> list[tuple[str, str]]:
    """Every registered metric, by name, with one line on what it computes."""
    return [(name, summary(name)) for name in metrics.available()]


def coincidences(requested: Iterable[str], heads: Mapping[str, int]) -> list[str]:
    """Sentences naming requested metrics that score ``heads``' models (model id -> head
    outputs) identically, so a reader does not take their agreement for two opinions."""
    requested = set(requested)
    notes = []
    if {"sms", "isms"} <= requested:
        same = sorted(m for m, n in heads.items() if n <= ISMS_DIM)
        if same:
            models = ", ".join(same) if len(same) <= 6 else f"{len(same)} of the models"
            notes.append(
                f"sms and isms are the same score on {models}: isms projects a head to "
                f"{ISMS_DIM} outputs first, and a head of {ISMS_DIM} or fewer is left as it is."
            )
    return notes
