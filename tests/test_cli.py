"""The zoopick command end to end on the tiny zoo, in a real subprocess."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from zoopick.cli import app


def zoopick(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "zoopick.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_score_json(tiny_zoo, tiny_npz, tmp_path):
    r = zoopick(
        "score", "--zoo", tiny_zoo, "--data", tiny_npz, "-m", "leep", "-m", "knn",
        "--option", "knn.k=3", "--cache-dir", tmp_path / "cache", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dataset"] == "tiny"
    assert out["metrics"] == ["leep", "knn"]
    assert {m["id"] for m in out["models"]} == {"tiny-resnet", "tiny-vit", "tiny-efficientnet"}
    for m in out["models"]:
        assert set(m["scores"]) == {"leep", "knn"}
        assert 0.0 <= m["scores"]["knn"] <= 1.0
        assert set(m["seconds"]) == {"forward", "leep", "knn"}


def test_score_table_and_model_filter(tiny_zoo, tiny_imagefolder, tmp_path):
    r = zoopick(
        "score", "--zoo", tiny_zoo, "--data", tiny_imagefolder, "-m", "nce",
        "--model", "tiny-vit", "--max-per-class", "4", "--no-cache",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tiny-vit" in r.stdout and "tiny-resnet" not in r.stdout
    assert "ranked by nce" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "nope"], "unknown metric 'nope'"),
        (["-m", "leep", "--model", "ghost"], "ghost"),
        (["-m", "leep", "--option", "leep"], "METRIC.NAME=VALUE"),
        (["-m", "knn", "--option", "knn.bogus=1"], "bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_zoo, tiny_npz, tmp_path, args, message):
    # in-process (the same Typer app the console script runs) to keep the suite fast
    argv = ["score", "--zoo", str(tiny_zoo), "--data", str(tiny_npz), "--no-cache", *args]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert r.stdout == ""


def test_missing_dataset_and_zoo(tiny_zoo, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["score", "--zoo", str(tiny_zoo), "--data", str(tmp_path / "no.npz")])
    assert r.exit_code == 2 and "no.npz" in r.stderr
    r = runner.invoke(app, ["score", "--zoo", str(tmp_path / "nozoo.json"), "--data", "x.npz"])
    assert r.exit_code == 2 and "nozoo.json" in r.stderr


def test_metrics_lists_registry():
    r = CliRunner().invoke(app, ["metrics"])
    assert r.exit_code == 0
    for name in ("leep", "logme", "knn"):
        assert name in r.stdout


def test_version_prints_the_installed_version_and_exits_0():
    """``zoopick --version`` (a real subprocess) and the light client's ``--version`` (its app,
    as the full distribution ships it: the version is zoopick's there) print the version."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from zoopick.client.main import app as client_app

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    version = declared["project"]["version"]
    assert metadata.version("zoopick") == version
    done = zoopick("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"zoopick {version}\n", "")
    light = CliRunner().invoke(client_app, ["--version"])
    assert (light.exit_code, light.stdout) == (0, f"zoopick-client {version}\n")


def test_the_clients_console_prints_text_never_markup_or_terminal_control():
    """What the CLI prints comes in part from the server (names, errors): ``[/bold]`` made a
    table fail, and an escape sequence would have reached the terminal."""
    import io

    from zoopick.client.tables import PlainConsole, show, table, visible

    buf = io.StringIO()
    console = PlainConsole(file=buf, width=200)
    rows = table("name")
    rows.add_row("[/bold] x \x1b[31mred\x07")
    show(console, rows)
    console.print("[b]bold?[/b] \x1b]0;title\x07")
    out = buf.getvalue()
    assert "\x1b" not in out and "\x07" not in out
    assert "[/bold] x \\x1b[31mred\\x07" in out and "[b]bold?[/b] \\x1b]0;title\\x07" in out
    assert visible("tab\tand\nnewline é") == "tab\tand\nnewline é"
