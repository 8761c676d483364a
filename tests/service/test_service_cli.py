"""``zoopick migrate`` and ``zoopick keys create|list|revoke`` against a fresh SQLite file."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from zoopick.service.db import migrate
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.security import authenticate
from zoopick.service.settings import get_settings
from zoopick.service_cli import service_app


def test_migrate_then_manage_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ZOOPICK_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        early = runner.invoke(service_app, ["keys", "create", "--name", "ci"])
        assert early.exit_code == 2 and "zoopick migrate" in early.output

        done = runner.invoke(service_app, ["migrate"])
        assert done.exit_code == 0, done.output
        assert migrate.head() in done.output

        made = runner.invoke(service_app, ["keys", "create", "--name", "ci", "--admin"])
        assert made.exit_code == 0, made.output
        token = made.stdout.strip().splitlines()[-1]
        assert token.startswith("zp_")

        listed = runner.invoke(service_app, ["keys", "list"])
        assert token[:11] in listed.output and "admin" in listed.output
        assert token not in listed.output

        engine = make_engine(get_settings().database_url)
        with make_sessionmaker(engine)() as session:
            key = authenticate(session, token)
            assert key is not None and key.is_admin
        revoked = runner.invoke(service_app, ["keys", "revoke", token[:11]])
        assert revoked.exit_code == 0, revoked.output
        with make_sessionmaker(engine)() as session:
            assert authenticate(session, token) is None
        engine.dispose()
        assert runner.invoke(service_app, ["keys", "revoke", "zp_nothing"]).exit_code == 2
    finally:
        get_settings.cache_clear()


def _sweep(monkeypatch, tmp_path, database_url: str | None):
    """``zoopick sweep`` with its settings from the environment, as an operator runs it."""
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(tmp_path))
    if database_url is None:
        monkeypatch.delenv("ZOOPICK_DATABASE_URL", raising=False)
    else:
        monkeypatch.setenv("ZOOPICK_DATABASE_URL", database_url)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(service_app, ["sweep"])
    finally:
        get_settings.cache_clear()


def test_sweep_on_a_database_never_migrated_says_to_migrate(tmp_path, monkeypatch, request):
    """One line naming ``zoopick migrate`` and a non-zero exit, not SQLAlchemy's traceback:
    on the embedded SQLite file, on an empty PostgreSQL database, and (a schema behind the
    code) on one migrated only to its first revision."""
    sqlite = _sweep(monkeypatch, tmp_path / "embedded", None)
    databases = [sqlite]
    new_pg_database = request.getfixturevalue("new_pg_database")
    databases.append(_sweep(monkeypatch, tmp_path / "pg", new_pg_database()))
    for result in databases:
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.output.strip() == (
            "error: the database has no tables yet: run `zoopick migrate` first"
        )
    behind = new_pg_database()
    migrate.upgrade(behind, "0001")
    result = _sweep(monkeypatch, tmp_path / "behind", behind)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and "zoopick migrate" in lines[0], lines
    # and once migrated, the sweep runs
    migrate.upgrade(behind)
    result = _sweep(monkeypatch, tmp_path / "behind", behind)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "0 lost job(s) handled" in result.output


def test_serve_and_worker_help_say_where_the_settings_are():
    """Issue 41: ``serve --help`` listed no setting, and nothing said where the 49
    ``ZOOPICK_*`` variables are described: both commands' help names the settings reference,
    a page that exists."""
    page = "docs/operations/settings.md"
    assert (Path(__file__).resolve().parents[2] / page).is_file()
    for command in ("serve", "worker"):
        out = CliRunner().invoke(service_app, [command, "--help"], terminal_width=200).output
        assert "ZOOPICK_*" in out and page in out, out
