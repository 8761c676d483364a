"""``zoopick migrate`` and ``zoopick keys create|list|revoke`` against a fresh SQLite file."""

from __future__ import annotations

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
