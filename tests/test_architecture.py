"""The layout of docs/ARCHITECTURE.md holds: importing any module of ``zoopick`` touches no
disk (no data folder appears in the working directory or the home folder, even for the
worker's Celery app), and the trainer's contract is the one the API schema and the CLI use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORT_ALL = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)"
# ``python -m zoopick`` runs the CLI; Alembic's env.py runs only inside Alembic
NOT_IMPORTABLE = ("zoopick.__main__", "zoopick.service.migrations")


def test_importing_every_module_has_no_effect_on_disk(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    env["HOME"] = str(home)
    from tests.lint_imports import module_names

    names = [n for n in module_names() if not n.startswith(NOT_IMPORTABLE)]
    assert "zoopick.workers.celery_app" in names and len(names) > 40
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *names],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert list(cwd.iterdir()) == []
    assert [p for p in home.rglob("*") if "zoopick" in str(p)] == []


RANK_A_JOB = """
import sys, uuid
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
import zoopick.app.main
from zoopick.service import pipeline
from zoopick.service.db.models import Base, Job
engine = create_engine("sqlite://")
Base.metadata.create_all(engine)
with Session(engine) as session:
    job = Job(tenant_id=uuid.uuid4(), dataset_id=uuid.uuid4(), status="scoring", request={},
              models=["a", "b"], metrics=["m"], select_by="m", task_ids=[])
    session.add(job)
    session.flush()
    for model, value in (("a", 0.1), ("b", 0.7)):
        pipeline.upsert_scores(session, job.id, model, {"m": value}, {})
    print([r["model"] for r in pipeline.ranking(session, job)])
print([m for m in ("numpy", "scipy", "sklearn", "torch") if m in sys.modules])
"""


def test_the_api_ranks_a_job_without_importing_the_metrics():
    """Every poll of a job ranks its stored scores (``pipeline.ranking``); if that pulled in
    numpy, scipy and scikit-learn, the first poll of every API process would stall for
    seconds."""
    done = subprocess.run(
        [sys.executable, "-c", RANK_A_JOB], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['b', 'a']", "[]"]


def test_one_finetune_contract_from_the_api_body_to_the_trainer():
    """The job body's ``finetune`` is the trainer's own ``FinetuneOptions`` (one class, one set
    of defaults), ``zoopick train``'s flags default to it, and a run's config is those options
    placed, handed over as one JSON document and read back unchanged."""
    import typer

    from zoopick.app.api.schemas import JobOut
    from zoopick.cli import app
    from zoopick.service.jobs import JobCreate
    from zoopick.training.config import FinetuneConfig, FinetuneOptions

    assert JobCreate.model_fields["finetune"].annotation == FinetuneOptions | None
    assert JobOut.model_fields["finetune"].annotation == FinetuneOptions | None
    command = typer.main.get_command(app).commands["train"]
    cli = {p.name: p.default for p in command.params}
    defaults = FinetuneOptions()
    for name in ("epochs", "compressor", "density", "lr", "batch_size", "optimizer", "seed"):
        assert cli[name] == getattr(defaults, name), name

    options = FinetuneOptions.model_validate_json(
        '{"epochs": 5, "compressor": "topk", "density": 0.1, "workers": 3, "lr": 0.2}'
    )
    cfg = FinetuneConfig.for_run(options, zoo="z", model="m", data="d", out="o", resume=True)
    chosen = (cfg.epochs, cfg.compressor, cfg.density, cfg.lr, cfg.workers)
    assert chosen == (5, "topk", 0.1, 0.2, 3)
    assert cfg.resume and cfg.batch_size == defaults.batch_size
    assert FinetuneConfig.from_json(cfg.to_json()) == cfg
    # as a job row stores them (JSON), read back without a second validation
    stored = FinetuneOptions.stored(options.model_dump(mode="json"))
    assert stored == options


def test_a_submission_is_validated_without_importing_torch():
    """The API process checks a job's hook and its options without loading torch (the hooks'
    option models are torch-free); a bad option is refused naming it."""
    code = (
        "import sys\n"
        "import zoopick.app.main\n"
        "from pydantic import ValidationError\n"
        "from zoopick.service.jobs import JobCreate\n"
        "from zoopick.selection.metrics import available\n"
        "available()\n"
        "ds = '00000000-0000-0000-0000-000000000001'\n"
        "spec = {'compressor': 'spardl', 'hook_options': {'teams': 2}}\n"
        "JobCreate.model_validate({'dataset_id': ds, 'finetune': spec})\n"
        "cases = (({'teams': 0}, 'teams'), ({'nope': 1}, 'nope'), ({'momentum': 0.9}, 'twice'))\n"
        "for bad, word in cases:\n"
        "    ft = {'compressor': 'spardl', 'optimizer': 'sgd', 'hook_options': bad}\n"
        "    body = {'dataset_id': ds, 'finetune': ft}\n"
        "    try:\n"
        "        JobCreate.model_validate(body)\n"
        "    except ValidationError as exc:\n"
        "        assert word in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit(f'{bad} accepted')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_epoch_records_round_trip_and_other_lines_are_ignored():
    from zoopick.training.config import EpochRecord, TrainerError, parse_line

    record = EpochRecord(
        epoch=2,
        loss=0.5,
        train_accuracy=0.75,
        test_accuracy=0.625,
        bytes_sent=1024.0,
        compute_seconds=1.5,
        select_seconds=0.25,
        comm_seconds=0.125,
        workers=4,
        compressor="spardl",
    )
    assert parse_line(record.to_json() + "\n") == record
    # the wire names are the trainer's (train_acc, seconds.communicate, ...)
    wire = record.to_dict()
    assert wire["train_acc"] == 0.75 and wire["seconds"]["communicate"] == 0.125
    assert parse_line('{"error": "RuntimeError: boom", "rank": 3}') == TrainerError(
        "RuntimeError: boom", 3
    )
    for other in ("Traceback (most recent call last):", '{"epoch": ', "[1, 2]", "{}", ""):
        assert parse_line(other) is None


def test_the_import_contracts_hold_and_catch_a_wrong_way_import(tmp_path):
    """The layers of pyproject's import-linter contracts are kept by the code as it is, and a
    core module importing a face (or a library importing the web stack) breaks them."""
    from tests.lint_imports import lint, package_tree

    tree = package_tree(tmp_path / "tree")
    kept = lint(tree)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "5 kept, 0 broken" in kept.stdout

    settings = tree / "zoopick" / "service" / "settings.py"
    settings.write_text(settings.read_text() + "\nimport zoopick.workers.tasks  # noqa\n")
    extract = tree / "zoopick" / "selection" / "extract.py"
    extract.write_text(extract.read_text() + "\nimport fastapi  # noqa\n")
    client = tree / "zoopick" / "client" / "http.py"  # the client speaks HTTP only
    client.write_text(client.read_text() + "\nimport zoopick.service.settings  # noqa\n")
    page = tree / "zoopick" / "app" / "dashboard" / "pages.py"  # pages use the API's functions
    page.write_text(page.read_text() + "\nimport zoopick.selection.rank  # noqa\n")
    broken = lint(tree)
    assert broken.returncode != 0
    assert "zoopick.service.settings -> zoopick.workers.tasks" in broken.stdout
    assert "zoopick.selection.extract -> fastapi" in broken.stdout
    assert "zoopick.client.http -> zoopick.service.settings" in broken.stdout
    assert "zoopick.app.dashboard.pages -> zoopick.selection.rank" in broken.stdout
    assert "python -m tests.lint_imports" in (ROOT / "README.md").read_text()  # CI runs it


def test_error_lines_of_ranks_sharing_a_pipe_never_interleave():
    """Ranks share torchrun's stderr, unbuffered: each line must reach the pipe whole."""
    import subprocess

    writer = (
        "import sys\n"
        "from zoopick.training.config import TrainerError, write_line\n"
        "for i in range(300):\n"
        "    write_line(sys.stderr, TrainerError('ValueError: ' + 'x' * 200, int(sys.argv[1]))"
        ".to_json())\n"
    )
    shell = " & ".join(f'{sys.executable} -c "$W" {rank}' for rank in range(3)) + " & wait"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "W": writer}
    done = subprocess.run(
        ["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=120
    )
    from zoopick.training.config import TrainerError, parse_line

    parsed = [parse_line(line) for line in done.stderr.splitlines()]
    assert len(parsed) == 900
    assert all(isinstance(p, TrainerError) for p in parsed)
    assert sorted({p.rank for p in parsed}) == [0, 1, 2]
