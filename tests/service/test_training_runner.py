"""The trainer subprocess runner, with a stand-in trainer script (the real trainer is
exercised by the fine-tuning end-to-end test): epoch lines reach the callback as they are
printed, a failing rank's error is reported, and a stop request takes the process group down."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from sqlalchemy.orm import Session

from zoopick.workers import training_runner

TRAINER = textwrap.dedent(
    """
    import json, signal, subprocess, sys, time
    epochs, fail, pause = int(sys.argv[1]), sys.argv[2] == "fail", float(sys.argv[3])

    def stopped(*_):  # as torchrun goes down on SIGTERM: a traceback naming server paths
        print('Traceback (most recent call last):\\n  File "/srv/zoopick/torchrun.py"',
              file=sys.stderr, flush=True)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stopped)
    # a child in the same group, like torchrun's ranks
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("starting", flush=True)
    for e in range(1, epochs + 1):
        time.sleep(pause)
        progress = {"event": "progress", "phase": "training", "epoch": e, "epochs": epochs,
                    "step": 1, "steps": 2, "loss": 0.5, "train_acc": 0.25, "host": "h1"}
        print(json.dumps(progress), flush=True)
        print(json.dumps({"epoch": e, "loss": 1.0 / e, "train_acc": 0.5}), flush=True)
    if fail:
        print(json.dumps({"error": "RuntimeError: NCCL timeout", "rank": 1}), file=sys.stderr)
        child.kill()
        sys.exit(1)
    child.kill()
    """
)


def start(tmp_path, *args: str):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    return lambda: subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_records_arrive_in_order_and_success(tmp_path):
    records, checks, events = [], [], []
    result = training_runner.run(
        start(tmp_path, "3", "ok", "0.05"),
        on_record=records.append,
        keep_going=lambda: checks.append(1) or True,
        on_event=events.append,
        poll=0.5,
        log=tmp_path / "run",
    )
    assert result.returncode == 0 and not result.stopped and result.error is None
    assert [r.epoch for r in records] == [1, 2, 3] and result.records == 3
    assert checks  # asked between epochs
    # progress events reach the callback, in order, and stay out of the log, which keeps
    # everything else the trainer printed
    assert [(e.event, e.epoch, e.step, e.loss, e.host) for e in events] == [
        ("progress", e, 1, 0.5, "h1") for e in (1, 2, 3)
    ]
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert log[0] == "[stdout] starting" and len(log) == 4 and '"epoch": 3' in log[-1]


def test_a_failing_rank_names_its_error(tmp_path):
    result = training_runner.run(
        start(tmp_path, "1", "fail", "0"),
        on_record=lambda r: None,
        keep_going=lambda: True,
        log=tmp_path,
    )
    assert result.returncode == 1
    assert result.error == "rank 1: RuntimeError: NCCL timeout"
    assert '[stderr] {"error": "RuntimeError: NCCL timeout"' in (tmp_path / "train.log").read_text()


def live_in_group(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    return [
        ln for ln in out.splitlines() if ln.split()[0] == str(pgid) and "Z" not in ln.split()[1]
    ]


def test_stop_kills_the_whole_process_group(tmp_path):
    t0 = time.monotonic()
    seen, procs = [], []
    launch = start(tmp_path, "100", "ok", "0.2")

    def started():
        procs.append(launch())
        return procs[-1]

    result = training_runner.run(
        started,
        on_record=seen.append,
        keep_going=lambda: len(seen) < 2,
        poll=0.2,
    )
    assert result.stopped and result.error is None
    assert 2 <= len(seen) < 10 and time.monotonic() - t0 < 15
    time.sleep(0.2)
    assert live_in_group(procs[0].pid) == []  # the grandchild "rank" went down too


STUBBORN = textwrap.dedent(
    """
    import json, signal, subprocess, sys, time
    # a "rank" that ignores SIGTERM: torchrun's own teardown would not stop it
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)
    for e in range(1, 100):
        print(json.dumps({"epoch": e}), flush=True)
        time.sleep(0.2)
    """
)


def test_stop_also_kills_a_rank_that_ignores_sigterm(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    procs = []

    def started():
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
        return procs[-1]

    seen = []
    result = training_runner.run(
        started, on_record=seen.append, keep_going=lambda: not seen, poll=0.2
    )
    assert result.stopped
    time.sleep(0.2)
    assert live_in_group(procs[0].pid) == []


def test_the_trainer_dies_with_the_task_process(tmp_path):
    """A worker process killed outright (hard time limit, out of memory) takes its trainer
    along: the trainer is started with a parent-death signal."""
    pid_file = tmp_path / "trainer.pid"
    task = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from zoopick.service.processes import die_with_parent
        trainer = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        open({str(pid_file)!r}, "w").write(str(trainer.pid))
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", task])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    trainer = int(pid_file.read_text())
    assert live_in_group(trainer)
    parent.kill()  # SIGKILL: no cleanup code runs in the task process
    parent.wait()
    deadline = time.monotonic() + 10
    while live_in_group(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_in_group(trainer) == []


def test_lowered_priority_nices_the_child_and_its_session():
    """``serve`` starts its local worker, and a worker its trainer, in a session of its own
    through ``lowered_priority`` (issue 21, item 14): the child runs that much nicer than its
    parent, and where Linux shares the cores between sessions first (autogroup), its session
    is as nice as the child; the parent-death step still runs."""
    import os
    from pathlib import Path

    from zoopick.service.processes import lowered_priority

    show = "import os; print(os.nice(0)); print(open('/proc/self/autogroup').read().split()[-1])"
    if not Path("/proc/self/autogroup").exists():
        show = "import os; print(os.nice(0)); print(os.nice(0))"  # no autogroups: nothing more
    out = subprocess.run(
        [sys.executable, "-c", show],
        start_new_session=True,
        preexec_fn=lowered_priority(3, then=lambda: os.write(1, b"then\n")),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    nicer = str(min(19, os.nice(0) + 3))
    assert out == ["then", nicer, nicer]
    # a trainer, started by that worker in a session of its own, stays as nice as it
    trainer = (
        "import subprocess, sys; from zoopick.service.processes import lowered_priority; "
        f"subprocess.run([sys.executable, '-c', {show!r}], start_new_session=True, "
        "preexec_fn=lowered_priority(0), check=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", trainer],
        start_new_session=True,
        preexec_fn=lowered_priority(3),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [nicer, nicer]


# -- follow_run: a task following its run against the database ---------------------------------


@pytest.fixture(scope="module")
def jobs_db(new_pg_database):
    """A migrated database of this module's own, and a job in it to follow."""
    from zoopick.service.db import migrate
    from zoopick.service.db.models import Job
    from zoopick.service.db.session import make_engine, make_sessionmaker
    from zoopick.service.security import get_or_create_tenant

    url = new_pg_database()
    migrate.upgrade(url)
    engine = make_engine(url)
    factory = make_sessionmaker(engine)

    def new_job() -> uuid.UUID:
        with factory.begin() as session:
            tenant = get_or_create_tenant(session, "runner").id
            job = Job(
                tenant_id=tenant,
                request={},
                models=["m1"],
                metrics=["logme"],
                select_by="logme",
                finetune={"epochs": 1},
                status="training",
            )
            session.add(job)
            session.flush()
            return job.id

    yield factory, new_job
    engine.dispose()


def test_follow_run_renews_between_records_and_honours_a_cancel(tmp_path, jobs_db):
    """``follow_run`` (the fine-tune's and the race's rungs' loop) renews the task's lease at
    every check, and a cancel requested on the job stops the run (not a lost lease)."""
    from sqlalchemy import update

    from zoopick.service.db.models import Job

    factory, new_job = jobs_db
    jid = new_job()
    renewals, seen, procs = [], [], []
    launch = start(tmp_path, "100", "ok", "0.1")

    def started():
        procs.append(launch())
        return procs[-1]

    def on_record(record) -> None:
        seen.append(record)
        if len(seen) == 2:
            with factory.begin() as session:
                session.execute(update(Job).where(Job.id == jid).values(cancel_requested=True))

    result = training_runner.follow_run(
        started,
        factory,
        jid,
        renew=lambda session: renewals.append(session) or True,
        on_time_limit=lambda session: pytest.fail("no time limit here"),
        on_record=on_record,
        poll=0.2,
        log=tmp_path / "run",
    )
    assert result.stopped and not result.lease_lost and result.error is None
    assert 2 <= len(seen) < 10
    # the log ends saying so, not in the trainer's traceback of the signal
    lines = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert lines[-1] == f"[zoopick] {training_runner.CANCELLED_NOTE}", lines[-3:]
    assert "[stdout] starting" in lines and not any("/srv/" in line for line in lines)
    assert len(renewals) >= 2 and all(isinstance(s, Session) for s in renewals)
    time.sleep(0.2)
    assert live_in_group(procs[0].pid) == []


def test_follow_run_stops_when_another_task_took_the_lease(tmp_path, jobs_db):
    factory, new_job = jobs_db
    jid = new_job()
    seen = []
    result = training_runner.follow_run(
        start(tmp_path, "100", "ok", "0.1"),
        factory,
        jid,
        renew=lambda session: not seen,  # renewed until the first record, then lost
        on_time_limit=lambda session: pytest.fail("no time limit here"),
        on_record=seen.append,
        poll=0.2,
    )
    assert result.stopped and result.lease_lost
    assert 1 <= len(seen) < 10


def test_follow_run_records_the_time_limit_and_lets_it_go_on(tmp_path, jobs_db):
    """The task's soft time limit, raised while the run goes on, is recorded by
    ``on_time_limit`` in a session that is committed, and raised again; the trainer stops."""
    from celery.exceptions import SoftTimeLimitExceeded
    from sqlalchemy import update

    from zoopick.service.db.models import Job

    factory, new_job = jobs_db
    jid = new_job()
    procs = []
    launch = start(tmp_path, "100", "ok", "0.1")

    def started():
        procs.append(launch())
        return procs[-1]

    def on_record(record) -> None:
        raise SoftTimeLimitExceeded()

    def timed_out(session) -> None:
        session.execute(update(Job).where(Job.id == jid).values(error="timed out"))

    with pytest.raises(SoftTimeLimitExceeded):
        training_runner.follow_run(
            started,
            factory,
            jid,
            renew=lambda session: True,
            on_time_limit=timed_out,
            on_record=on_record,
            poll=0.2,
        )
    with factory() as session:
        assert session.get(Job, jid).error == "timed out"
    time.sleep(0.2)
    assert live_in_group(procs[0].pid) == []
