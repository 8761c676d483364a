"""Where a job's work stands, stage by stage, for the API and the dashboard.

Training: the trainer's progress events (``training.config.RunEvent`` "progress") folded into
the run's ``progress`` column: the phase (starting workers, loading data, training epoch i of
n at step j of m, evaluating, saving the model), the hosts it runs on, and the sub-epoch
points of the curve (bounded). Elapsed and expected time are worked out when read, from the
run's start and the share of its steps done since its first step.

Scoring: what share of the models is settled (scored on every metric, or skipped), which the
forward pass came from the cache, and, once the job ended, which were never scored.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from typing import Any

from zoopick.training.config import RunEvent

MAX_POINTS = 400
"""Sub-epoch points kept per run: past this, every other one is dropped (the curve keeps its
shape, the row its size)."""


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat()


def _parse(text: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text))
    except ValueError:
        return None


def starting(progress: dict[str, Any] | None, host: str | None = None) -> dict[str, Any]:
    """A run that a worker is (re)starting: its phase, and this worker's host added."""
    state = dict(progress or {})
    host = host or socket.gethostname()
    hosts = list(state.get("hosts") or [])
    if host not in hosts:
        hosts.append(host)
    state.update(phase="starting workers", hosts=hosts[-32:])
    for key in ("step", "t0", "f0"):
        state.pop(key, None)  # a resumed run measures its pace afresh
    return state


def fraction(state: dict[str, Any]) -> float | None:
    """The share of the run's epochs done, counting the steps of the current one."""
    epochs, epoch = state.get("epochs"), state.get("epoch")
    if not epochs or not epoch:
        return None
    steps, step = state.get("steps") or 0, state.get("step")
    if state.get("phase") in ("evaluating", "saving the model") or step is None or not steps:
        within = 1.0 if state.get("phase") != "training" else 0.0
    else:
        within = min(step / steps, 1.0)
    return min(1.0, (epoch - 1 + within) / epochs)


def apply(
    progress: dict[str, Any] | None, event: RunEvent, now: datetime | None = None
) -> dict[str, Any]:
    """The run's progress after ``event``."""
    now = now or datetime.now(UTC)
    state = dict(progress or {})
    state["phase"] = event.phase or state.get("phase")
    for key in ("epoch", "epochs", "step", "steps"):
        value = getattr(event, key)
        if value is not None:
            state[key] = value
    if event.host:
        hosts = list(state.get("hosts") or [])
        if event.host not in hosts:
            hosts.append(event.host)
        state["hosts"] = hosts[-32:]
    done = fraction(state)
    if state.get("phase") == "training" and done is not None and "t0" not in state:
        state.update(t0=_iso(now), f0=done)  # the pace is measured from the first step
    if event.loss is not None and event.epoch and event.step and event.steps:
        x = event.epoch - 1 + event.step / event.steps
        points = [p for p in state.get("points") or [] if p[0] < x]  # a resume redraws
        points.append([round(x, 4), event.loss, event.train_acc])
        if len(points) > MAX_POINTS:
            points = points[::2]
        state["points"] = points
    state["updated_at"] = _iso(now)
    return state


def run_view(
    progress: dict[str, Any] | None,
    started_at: datetime,
    finished_at: datetime | None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """What the API shows of a run's progress (``app.api.schemas.RunProgressOut``)."""
    now = now or datetime.now(UTC)
    state = progress or {}
    end = finished_at or now
    elapsed = max(0.0, (end - started_at).total_seconds())
    done = fraction(state)
    remaining = None
    t0 = _parse(state.get("t0"))
    f0 = float(state.get("f0") or 0.0)
    if finished_at is None and done is not None and t0 is not None and done > f0:
        pace = max(0.0, (now - t0).total_seconds()) / (done - f0)
        remaining = pace * (1.0 - done)
    phase = state.get("phase")
    if finished_at is not None:
        phase = "finished"
    return {
        "phase": phase,
        "epoch": state.get("epoch"),
        "epochs": state.get("epochs"),
        "step": state.get("step") if phase == "training" else None,
        "steps": state.get("steps"),
        "fraction": done,
        "elapsed_seconds": elapsed,
        "remaining_seconds": remaining,
        "hosts": list(state.get("hosts") or []),
        "points": [
            {"x": p[0], "loss": p[1], "train_accuracy": p[2]} for p in state.get("points") or []
        ],
    }


def scoring_view(
    models: list[str], ranked: list[str], errors: dict[str, Any], finished: bool
) -> dict[str, Any]:
    """How far scoring is: models settled (ranked or skipped) of all; once the job ended,
    those never scored (a cancelled job stops between models)."""
    settled = (set(ranked) | set(errors)) & set(models)
    never = [m for m in models if m not in settled] if finished else []
    return {
        "done": len(settled),
        "total": len(models),
        "fraction": len(settled) / max(1, len(models)),
        "never_scored": never,
    }
