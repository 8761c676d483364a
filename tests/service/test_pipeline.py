"""The job state machine, the lease and the idempotent writes, on PostgreSQL and SQLite:
what makes a re-delivered or racing task harmless."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from zoopick.service import pipeline
from zoopick.service.db import migrate
from zoopick.service.db.models import EpochMetric, Job, JobStatus, Score, ScoreLease, TrainingRun
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.db.types import utcnow
from zoopick.service.security import get_or_create_tenant
from zoopick.training.config import parse_line

S = JobStatus


@pytest.fixture(params=["sqlite", "postgresql"], scope="module")
def factory(request, tmp_path_factory):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('pipe') / 'p.db'}"
        migrate.upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def job(factory) -> uuid.UUID:
    with factory.begin() as session:
        tenant = get_or_create_tenant(session, "pipeline")
        row = Job(
            tenant_id=tenant.id,
            request={},
            models=["a", "b"],
            metrics=["sms", "logme"],
            select_by="sms",
        )
        session.add(row)
        session.flush()
        return row.id


def status(factory, job_id) -> str:
    with factory() as session:
        return session.get(Job, job_id).status


def test_state_machine_moves_forward_only(factory, job):
    with factory.begin() as s:
        assert not pipeline.transition(s, job, S.training)  # queued -> training: not allowed
        assert pipeline.transition(s, job, S.scoring)
        assert pipeline.transition(s, job, S.scoring) is False  # already there
        assert pipeline.transition(s, job, S.succeeded, chosen_model="a")
    with factory.begin() as s:
        for target in (S.failed, S.cancelled, S.scoring, S.training):
            assert not pipeline.transition(s, job, target)  # terminal stays terminal
        row = s.get(Job, job)
        assert row.status == "succeeded" and row.progress == 1.0
        assert row.finished_at >= row.started_at and row.chosen_model == "a"


def test_cancel_if_queued_only_touches_queued_jobs(factory, job):
    with factory.begin() as s:
        pipeline.transition(s, job, S.scoring)
        assert not pipeline.finish_cancelled_if_queued(s, job)
        assert pipeline.fail(s, job, "boom")
        assert not pipeline.finish_cancelled(s, job)
    assert status(factory, job) == "failed"


@pytest.mark.parametrize("end", [S.cancelled, S.failed])
def test_a_race_ended_with_its_job_leaves_no_candidate_queued(factory, job, end):
    """Candidates no task started are cancelled with the job (an outside probe saw them
    'queued' for good in a cancelled race); a running one is its task's to settle, and a
    settled one keeps its outcome."""
    from zoopick.service.db.models import RaceEntry

    with factory.begin() as s:
        assert pipeline.transition(s, job, S.scoring)
        assert pipeline.transition(s, job, S.racing)
        for model, rung, state in (("a", 0, "done"), ("b", 0, "running"), ("a", 1, "queued")):
            s.add(RaceEntry(job_id=job, model_id=model, rung=rung, status=state, target_steps=4))
    with factory.begin() as s:
        assert pipeline.transition(s, job, end, **({"error": "boom"} if end is S.failed else {}))
    with factory() as s:
        rows = s.scalars(select(RaceEntry).where(RaceEntry.job_id == job)).all()
        states = {(e.model_id, e.rung): e.status for e in rows}
    assert states == {("a", 0): "done", ("b", 0): "running", ("a", 1): "cancelled"}


def test_lease_is_exclusive_until_it_expires(factory, job):
    with factory.begin() as s:
        assert pipeline.claim_lease(s, job, "w1", 60)
        assert not pipeline.claim_lease(s, job, "w2", 60)
        assert pipeline.claim_lease(s, job, "w1", 60)  # re-entrant for its owner
        assert pipeline.renew_lease(s, job, "w1", 60)
        assert not pipeline.renew_lease(s, job, "w2", 60)
        s.execute(update(Job).where(Job.id == job).values(lease_expires_at=utcnow() - timedelta(1)))
        assert pipeline.claim_lease(s, job, "w2", 60)  # w1 died: w2 takes over
        assert not pipeline.renew_lease(s, job, "w1", 60)  # and w1 learns it lost it
        pipeline.release_lease(s, job, "w2")
        assert s.get(Job, job).lease_owner is None


def test_a_models_scoring_lease_is_exclusive_until_it_expires(factory, job):
    """Each model's own lease (``score_leases``): one live task scores a model; another model
    is leased apart; a dead holder's lease is taken over; settling the model drops it."""
    with factory.begin() as s:
        assert pipeline.claim_model_lease(s, job, "a", "w1", 60)
        assert not pipeline.claim_model_lease(s, job, "a", "w2", 60)  # w1 scores it
        assert pipeline.claim_model_lease(s, job, "b", "w2", 60)  # another model: its own
        assert pipeline.claim_model_lease(s, job, "a", "w1", 60)  # re-entrant for its owner
        assert pipeline.renew_model_lease(s, job, "a", "w1", 60)
        assert not pipeline.renew_model_lease(s, job, "a", "w2", 60)
        gone = utcnow() - timedelta(seconds=1)
        lease_a = update(ScoreLease).where(ScoreLease.job_id == job, ScoreLease.model_id == "a")
        s.execute(lease_a.values(lease_expires_at=gone))
        assert pipeline.claim_model_lease(s, job, "a", "w3", 60)  # w1 died: w3 takes over
        assert not pipeline.renew_model_lease(s, job, "a", "w1", 60)  # and w1 learns it
        pipeline.release_model_lease(s, job, "a")
        held = {(r.model_id, r.lease_owner) for r in s.scalars(select(ScoreLease))
                if r.job_id == job}  # fmt: skip
        assert held == {("b", "w2")}


def test_scores_are_upserted_and_progress_counts_complete_models(factory, job):
    with factory.begin() as s:
        pipeline.transition(s, job, S.scoring)
        pipeline.upsert_scores(s, job, "a", {"sms": 1.0, "logme": 2.0}, {"sms": 0.1, "forward": 3})
        pipeline.upsert_scores(s, job, "b", {"sms": 5.0}, {})
        row = s.get(Job, job)
        assert pipeline.scored_models(s, row) == {"a"}
        assert pipeline.update_scoring_progress(s, row) == 0.5
    with factory.begin() as s:  # the same task again (re-delivery), with new values
        pipeline.upsert_scores(s, job, "a", {"sms": 1.5, "logme": 2.0}, {"sms": 0.2})
        pipeline.upsert_scores(s, job, "b", {"sms": 5.0, "logme": 0.5}, {})
        n = s.scalar(select(func.count()).select_from(Score).where(Score.job_id == job))
        assert n == 4
        row = s.get(Job, job)
        assert pipeline.update_scoring_progress(s, row) == 1.0
        ranked = pipeline.ranking(s, row)
        assert [(r["rank"], r["model"]) for r in ranked] == [(1, "b"), (2, "a")]
        assert ranked[1]["scores"] == {"sms": 1.5, "logme": 2.0}
        assert pipeline.choose(s, row) == "b"


def test_ties_share_a_rank_and_go_to_the_first_listed(factory, job):
    with factory.begin() as s:
        for m in ("b", "a"):
            pipeline.upsert_scores(s, job, m, {"sms": 1.0, "logme": 1.0}, {})
        row = s.get(Job, job)
        assert [(r["rank"], r["model"]) for r in pipeline.ranking(s, row)] == [(1, "a"), (1, "b")]
        assert pipeline.choose(s, row) == "a"


def test_ncti_is_normalised_over_the_scored_zoo_at_selection(factory):
    """The service stored NCTI's single-model stand-in (its ncc term) and ranked by it; the
    paper's score is min-max normalised over the zoo. Hand-computed: seli' = (0, 1, 0.5),
    ncc' = (1, 8/9, 0), vc' = (0, 0, 1), so ``seli' + ncc' - vc'`` = (1, 17/9, -0.5): b wins
    where the stand-in (ncc) picked a."""
    with factory.begin() as s:
        tenant = get_or_create_tenant(s, "pipeline")
        row = Job(tenant_id=tenant.id, request={}, models=["a", "b", "c", "d"],
                  metrics=["ncti", "sms"], select_by="ncti")  # fmt: skip
        s.add(row)
        s.flush()
        jid = row.id
        parts = {"a": (1.0, 0.9, 0.2), "b": (3.0, 0.8, 0.2), "c": (2.0, 0.0, 0.6)}
        for model, p in parts.items():
            pipeline.upsert_scores(s, jid, model, {"ncti": p[1], "sms": 1.0}, {}, parts={"ncti": p})
        # d has NCTI only (sms missing: not scored), so it takes no part in the zoo
        pipeline.upsert_scores(s, jid, "d", {"ncti": 5.0}, {}, parts={"ncti": (9.0, 9.0, 0.0)})
        assert pipeline.choose(s, row) == "a"  # the stand-in, while scoring goes on
        pipeline.combine_zoo_scores(s, row)
        pipeline.combine_zoo_scores(s, row)  # again (a re-delivered selection): the same
        values = {r["model"]: r["scores"]["ncti"] for r in pipeline.ranking(s, row)}
        assert values == pytest.approx({"a": 1.0, "b": 17 / 9, "c": -0.5})
        assert pipeline.choose(s, row) == "b"
        sms = s.scalars(select(Score.parts).where(Score.job_id == jid, Score.metric == "sms"))
        assert set(sms) == {None}


def test_epoch_records_are_upserted(factory, job):
    with factory.begin() as s:
        run = TrainingRun(job_id=job, model_id="a", config={}, world_size=2, output_dir="/x")
        s.add(run)
        s.flush()
        record = {
            "epoch": 1,
            "loss": 2.5,
            "train_acc": 0.25,
            "test_acc": 0.5,
            "bytes_sent": 1024,
            "seconds": {"compute": 1.0, "select": 0.1, "communicate": 0.2},
            "workers": 2,
        }
        # the trainer's line, read as the service reads it
        pipeline.record_epoch(s, run.id, parse_line(json.dumps(record)))
        pipeline.record_epoch(s, run.id, parse_line(json.dumps({**record, "loss": 2.0})))
        rows = list(s.scalars(select(EpochMetric).where(EpochMetric.run_id == run.id)))
        assert len(rows) == 1
        e = rows[0]
        assert (e.loss, e.train_accuracy, e.test_accuracy, e.bytes_sent) == (2.0, 0.25, 0.5, 1024)
        assert (e.compute_seconds, e.select_seconds, e.comm_seconds) == (1.0, 0.1, 0.2)
        assert e.extra == {"workers": 2}


def test_a_diverging_runs_lines_are_stored_with_their_unknown_numbers_as_null(factory, job):
    """Python's json writes NaN and Infinity; PostgreSQL's JSON refuses them, and a running
    loss of NaN in a progress event once failed the whole fine-tune task (the job ended
    "crashed" instead of with the rank's Diverged error). The lines are stored, the numbers
    that are not finite as null."""
    with factory.begin() as s:
        run = TrainingRun(job_id=job, model_id="a", config={}, world_size=2, output_dir="/x")
        s.add(run)
        s.flush()
        s.execute(update(TrainingRun).where(TrainingRun.id == run.id).values(status="running"))
        for loss in (float("nan"), float("inf"), -float("inf")):
            line = json.dumps(
                {"event": "progress", "phase": "training", "epoch": 1, "epochs": 2, "step": 3,
                 "steps": 10, "loss": loss, "train_acc": 0.5}
            )  # fmt: skip
            assert ("NaN" in line) or ("Infinity" in line)
            event = parse_line(line)
            assert event.loss is None and event.train_acc == 0.5
            pipeline.record_run_event(s, run.id, event)
        epoch = parse_line(json.dumps({"epoch": 1, "loss": float("nan"), "test_acc": 0.5}))
        assert epoch.loss is None and epoch.test_accuracy == 0.5
        pipeline.record_epoch(s, run.id, epoch)
        assert parse_line(json.dumps({"epoch": float("inf")})) is None  # not an OverflowError
    with factory() as s:
        stored = s.get(TrainingRun, run.id)
        assert stored.progress["step"] == 3 and stored.progress["phase"] == "training"
        row = s.scalar(select(EpochMetric).where(EpochMetric.run_id == run.id))
        assert row.loss is None and row.test_accuracy == 0.5
