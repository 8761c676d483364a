"""What the job and compare pages draw, shaped from the API's job object (``JobOut``): the
score bars, the training curves (loss and accuracy on their own axes, the sub-epoch points
beside the per-epoch ones) and the bytes sent. Kept apart from the routes so the two pages
draw the same curves the same way."""

from __future__ import annotations

from markupsafe import Markup

from zoopick.app.api.schemas import JobOut
from zoopick.app.dashboard import charts


def metric_charts(job: JobOut) -> list[Markup]:
    ranking = job.ranking
    return [
        charts.bar_chart(
            f"{metric} score per model",
            [(r.model, r.scores[metric]) for r in ranking if metric in r.scores],
            highlight=job.chosen_model,
        )
        for metric in job.metrics
        if any(metric in r.scores for r in ranking)
    ]


def training_charts(job: JobOut) -> list[Markup]:
    """Loss, then accuracy (train and test, 0 to 1), then bytes sent against dense."""
    if job.training is None:
        return []
    epochs = job.training.epochs
    points = job.training.progress.points if job.training.progress else []
    out: list[Markup] = []
    loss = {
        "loss (epoch)": [(e.epoch, e.loss) for e in epochs if e.loss is not None],
        "loss within epoch": [(p.x, p.loss) for p in points if p.loss is not None],
    }
    if any(loss.values()):
        out.append(
            charts.line_chart(
                "training loss", loss, y_label="cross-entropy", thin=("loss within epoch",)
            )
        )
    accuracy = {
        "train (epoch)": [
            (e.epoch, e.train_accuracy) for e in epochs if e.train_accuracy is not None
        ],
        "test": [(e.epoch, e.test_accuracy) for e in epochs if e.test_accuracy is not None],
        "train within epoch": [
            (p.x, p.train_accuracy) for p in points if p.train_accuracy is not None
        ],
    }
    if any(accuracy.values()):
        out.append(
            charts.line_chart(
                "train and test accuracy",
                accuracy,
                y_label="accuracy",
                y_range=(0.0, 1.0),
                thin=("train within epoch",),
            )
        )
    per_iteration = [e for e in epochs if e.iterations and e.bytes_sent is not None]
    if per_iteration:  # the trainer reports its dense all-reduce baseline
        out.append(
            charts.line_chart(
                "bytes sent per iteration (per worker) vs dense all-reduce",
                {
                    "sent": [(e.epoch, e.bytes_sent / e.iterations) for e in per_iteration],
                    "dense all-reduce": [
                        (e.epoch, e.dense_bytes / e.iterations)
                        for e in per_iteration
                        if e.dense_bytes is not None
                    ],
                },
                y_label="bytes",
            )
        )
    else:
        sent = [(f"epoch {e.epoch}", float(e.bytes_sent)) for e in epochs if e.bytes_sent]
        if sent:
            out.append(charts.bar_chart("bytes sent per worker per epoch", sent))
    return out


def race_chart(job: JobOut) -> Markup:
    """Validation accuracy of each raced model against the optimizer steps it holds, one line
    per model across the rungs it ran (a dropped model's line stops where it was dropped)."""
    if job.race is None:
        return Markup("")
    series: dict[str, list[tuple[float, float]]] = {m: [] for m in job.race.shortlist}
    for rung in job.race.rungs:
        for e in rung.entries:
            if e.steps is not None and e.val_accuracy is not None:
                series.setdefault(e.model, []).append((float(e.steps), e.val_accuracy))
    return charts.line_chart(
        "race: validation accuracy by steps trained",
        series,
        x_label="optimizer steps",
        y_label="validation accuracy",
        y_range=(0.0, 1.0),
    )


def compare_charts(jobs: list[JobOut]) -> list[Markup]:
    """The jobs' curves on shared axes: one series per job (its short id and model)."""

    def name(job: JobOut) -> str:
        model = job.training.model if job.training else job.chosen_model
        return f"{str(job.id)[:8]} {model or ''}".strip()

    trained = [j for j in jobs if j.training and j.training.epochs]
    if not trained:
        return []
    loss = {
        name(j): [(e.epoch, e.loss) for e in j.training.epochs if e.loss is not None]
        for j in trained
    }
    test = {
        name(j): [
            (e.epoch, e.test_accuracy) for e in j.training.epochs if e.test_accuracy is not None
        ]
        for j in trained
    }
    out = [charts.line_chart("training loss by job", loss, y_label="cross-entropy")]
    if any(test.values()):
        out.append(
            charts.line_chart("test accuracy by job", test, y_label="accuracy", y_range=(0.0, 1.0))
        )
    return out
