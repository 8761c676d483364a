"""``zoopick train`` end to end: torchrun starts 2 gloo workers, JSON lines come back."""

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from zoopick.cli import app


def test_train_two_workers_streams_epochs_and_writes_model(tiny_zoo, tiny_npz, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "zoopick.cli", "train", "--zoo", str(tiny_zoo),
         "--model", "tiny-vit", "--data", str(tiny_npz), "--workers", "2",
         "--compressor", "spardl", "--density", "0.1", "--epochs", "2", "--batch-size", "4",
         "--lr", "0.05", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    records = [rec for rec in lines if "event" not in rec]  # the rest: progress events
    assert [rec["epoch"] for rec in records] == [1, 2]
    assert {rec["event"] for rec in lines if "event" in rec} <= {"progress", "started", "recipe"}
    assert all(rec["compressor"] == "spardl" and rec["workers"] == 2 for rec in records)
    assert (out / "model.safetensors").is_file()
    meta = json.loads((out / "model.json").read_text())
    assert meta["source_model"] == "tiny-vit"
    assert len(meta["rank_digests"]) == 2 and len(set(meta["rank_digests"])) == 1


def test_train_rejects_bad_input_before_starting_workers(tiny_zoo, tiny_npz, tmp_path):
    runner = CliRunner()
    base = ["train", "--zoo", str(tiny_zoo), "--data", str(tiny_npz), "--out", str(tmp_path)]
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--compressor", "zip"])
    assert r.exit_code == 2 and "compressor" in r.stderr and "spardl" in r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--hook-option", "bogus=1"])
    assert r.exit_code == 2 and "bogus" in r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--compressor", "spardl",
                            "--hook-option", "teams=0"])  # fmt: skip
    assert r.exit_code == 2 and "teams" in r.stderr
    r = runner.invoke(app, [*base, "--model", "nope"])
    assert r.exit_code == 2 and "nope" in r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--hook-option", "teams"])
    assert r.exit_code == 2 and "NAME=VALUE" in r.stderr
    # a dataset that cannot feed the workers (24 images, 18 to train on), a class capped at
    # one image, a batch of one: refused here, where they failed inside started workers
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--workers", "10"])
    assert r.exit_code == 2 and "cannot feed 10 workers" in r.stderr, r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--max-per-class", "1"])
    assert r.exit_code == 2 and "no class 2 images" in r.stderr, r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--batch-size", "1"])
    assert r.exit_code == 2 and "batch-size" in r.stderr, r.stderr
    # test data whose classes are not the training data's: refused here, where the workers
    # found it once started (exit 1); the help states the open bounds the run checks
    import numpy as np

    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros((4, 8, 8), np.uint8), y=np.array([0, 1, 0, 1]),
             class_names=np.array(["cat", "dog"]))  # fmt: skip
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--test-data", str(other)])
    assert r.exit_code == 2 and "the training data never has" in r.stderr, r.stderr
    assert "'cat', 'dog'" in r.stderr and "'dark'" in r.stderr, r.stderr
    r = runner.invoke(app, [*base, "--model", "tiny-vit", "--lr", "0"])
    assert r.exit_code == 2 and "lr" in r.stderr and "greater than 0" in r.stderr, r.stderr
    helptext = " ".join(runner.invoke(app, ["train", "--help"]).stdout.split())
    assert "in (0, 10]" in helptext and "in (0, 1]" in helptext


def test_write_config_writes_the_checked_run_document(tiny_zoo, tiny_npz, tmp_path):
    """``--write-config``: the run as one JSON document, what ``python -m
    zoopick.training.launch --config`` reads under a torchrun the user starts."""
    from zoopick.training.config import FinetuneConfig
    from zoopick.training.launch import parse_args

    out = tmp_path / "r1"
    r = CliRunner().invoke(app, [
        "train", "--zoo", str(tiny_zoo), "--data", str(tiny_npz), "--out", str(out),
        "--model", "tiny-vit", "--compressor", "spardl", "--hook-option", "teams=2",
        "--workers", "4", "--write-config",
    ])  # fmt: skip
    assert r.exit_code == 0, r.stderr
    path = out / "run.json"
    assert r.stdout.strip() == str(path)
    cfg = parse_args(["--config", str(path)])
    assert isinstance(cfg, FinetuneConfig)
    assert (cfg.workers, cfg.compressor, cfg.hook_options) == (4, "spardl", {"teams": 2})
    assert not (out / "checkpoint.pt").exists()  # nothing ran


def test_write_config_names_files_absolutely_and_a_resume_knows_a_file_however_spelt(
    tiny_zoo, tiny_npz, tmp_path, monkeypatch
):
    """Relative paths given to ``zoopick train`` are written resolved, so OUT/run.json runs
    from any directory; and a checkpoint's config names the same files as ``./data.npz``
    or an absolute path (``same_run`` compares files, not strings)."""
    from zoopick.training.config import FinetuneConfig

    monkeypatch.chdir(tmp_path)
    zoo, data = os.path.relpath(tiny_zoo), "./" + os.path.relpath(tiny_npz)
    r = CliRunner().invoke(app, [
        "train", "--zoo", zoo, "--data", data, "--out", "r2", "--model", "tiny-vit",
        "--write-config",
    ])  # fmt: skip
    assert r.exit_code == 0, r.stderr
    cfg = FinetuneConfig.from_json((tmp_path / "r2" / "run.json").read_text())
    assert cfg.zoo == str(tiny_zoo.resolve()) and cfg.data == str(tiny_npz.resolve())
    assert cfg.out == str((tmp_path / "r2").resolve())
    spelt = cfg.model_copy(update={"data": data, "zoo": zoo})
    assert spelt.same_run(cfg.model_dump(mode="json")) == []
    moved = cfg.model_copy(update={"data": str(tmp_path / "elsewhere.npz"), "lr": 0.5})
    assert moved.same_run(cfg.model_dump(mode="json")) == ["data", "lr"]


def test_a_finished_worker_exits_with_its_code_and_its_output_flushed():
    """``launch.exit_now`` skips the interpreter's finalisation (see its docstring): what the
    worker printed into its pipes, still in Python's buffers, must arrive, and atexit work
    must not run (the finalisation is what it skips)."""
    code = (
        "import atexit, sys\n"
        "from zoopick.training.launch import exit_now\n"
        "atexit.register(lambda: print('finalised'))\n"
        "print('{\"epoch\": 1}'); sys.stderr.write('last words')\n"
        "exit_now(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert r.stdout == '{"epoch": 1}\n'
    assert r.stderr == "last words"


def test_a_worker_killed_by_sigabrt_leaves_its_python_stack():
    """A rank that aborts (``launch.main`` enables ``faulthandler``) says where it was: the
    worker's config parsing and its run are stand-ins here, the abort is real."""
    code = (
        "import os, signal, sys\n"
        "from zoopick.training import launch\n"
        "launch.parse_args = lambda argv: None\n"
        "import zoopick.training.finetune as ft\n"
        "def main_worker(cfg):\n"
        "    os.kill(os.getpid(), signal.SIGABRT)\n"
        "ft.main_worker = main_worker\n"
        "launch.main(['--config', 'unused.json'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -6
    assert "Fatal Python error: Aborted" in r.stderr
    assert "in main_worker" in r.stderr
