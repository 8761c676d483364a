"""Typed results of the client: plain dataclasses built from the API's JSON (``raw`` keeps
the whole document, for ``--json`` output and fields added later)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Dataset:
    id: str
    name: str
    status: str
    format: str
    size_bytes: int
    error: str | None
    classes: list[str] | None
    counts: dict[str, int] | None
    num_samples: int | None
    created_at: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Dataset:
        return cls(
            id=d["id"],
            name=d["name"],
            status=d["status"],
            format=d["format"],
            size_bytes=d["size_bytes"],
            error=d.get("error"),
            classes=d.get("classes"),
            counts=d.get("counts"),
            num_samples=d.get("num_samples"),
            created_at=d["created_at"],
            raw=d,
        )


@dataclass(frozen=True)
class RankedModel:
    rank: int
    model: str
    scores: dict[str, float]
    seconds: dict[str, float]


@dataclass(frozen=True)
class Epoch:
    epoch: int
    loss: float | None
    test_accuracy: float | None
    bytes_sent: int | None


@dataclass(frozen=True)
class Training:
    model: str
    status: str
    world_size: int
    error: str | None
    epochs: list[Epoch]
    recipe: dict[str, Any] | None = None
    """What the fine-tune recipe chose (the server's ``training.recipe``)."""


@dataclass(frozen=True)
class Job:
    id: str
    status: str
    progress: float
    error: str | None
    dataset_id: str | None
    models: list[str]
    metrics: list[str]
    select_by: str
    chosen_model: str | None
    cancel_requested: bool
    created_at: str
    ranking: list[RankedModel]
    training: Training | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def chosen_score(self) -> float | None:
        """The chosen model's score by the metric that chose it."""
        for r in self.ranking:
            if r.model == self.chosen_model:
                return r.scores.get(self.select_by)
        return None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Job:
        t = d.get("training")
        training = None
        if t:
            training = Training(
                model=t["model"],
                status=t["status"],
                world_size=t["world_size"],
                error=t.get("error"),
                epochs=[
                    Epoch(e["epoch"], e.get("loss"), e.get("test_accuracy"), e.get("bytes_sent"))
                    for e in t.get("epochs", [])
                ],
                recipe=t.get("recipe") if isinstance(t.get("recipe"), dict) else None,
            )
        return cls(
            id=d["id"],
            status=d["status"],
            progress=d["progress"],
            error=d.get("error"),
            dataset_id=d.get("dataset_id"),
            models=d.get("models", []),
            metrics=d.get("metrics", []),
            select_by=d["select_by"],
            chosen_model=d.get("chosen_model"),
            cancel_requested=d.get("cancel_requested", False),
            created_at=d["created_at"],
            ranking=[
                RankedModel(r["rank"], r["model"], r["scores"], r["seconds"])
                for r in d.get("ranking", [])
            ],
            training=training,
            raw=d,
        )


@dataclass(frozen=True)
class ZooModel:
    id: str
    arch: str
    num_classes: int
    source: str | None
    tags: list[str]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ZooModel:
        return cls(d["id"], d["arch"], d["num_classes"], d.get("source"), d.get("tags", []), d)
