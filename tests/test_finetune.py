"""The fine-tuning runner on real gloo process groups: every hook lowers the loss, a resumed
run continues the same run, and the final model loads with its data config."""

import json
import math

import numpy as np
import pytest
import torch

from tests.comm_harness import launch
from zoopick.training.comm import available
from zoopick.training.finetune import FINAL_CONFIG, FINAL_WEIGHTS, METRICS, FinetuneConfig, run


def _run_many(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """Several runs inside one launch (process start-up costs seconds); each record with the
    Triton switch its run left set in the process (``select.CUDA_TRITON``)."""
    from zoopick.training.comm import select

    return [run(FinetuneConfig(**c)) | {"triton": select.CUDA_TRITON} for c in configs]


def _cfg(tiny_zoo, tiny_npz, out, **kw) -> dict:
    base = FinetuneConfig(
        zoo=str(tiny_zoo),
        model="tiny-resnet",
        data=str(tiny_npz),
        out=str(out),
        epochs=4,
        batch_size=4,
        lr=0.05,
        density=0.1,
        test_fraction=0.25,
        recipe="fixed",  # these tests are about the hooks and the loop, not the recipe
    )
    return base.model_dump() | kw


def test_every_hook_lowers_the_loss(tiny_zoo, tiny_npz, tmp_path):
    hooks = available()
    assert {"dense", "topk", "gaussiank", "spardl", "exdyna", "dfs"} <= set(hooks)
    # spardl's run asks for the fused selection (a CUDA path: on the CPU the same selection)
    configs = [
        _cfg(tiny_zoo, tiny_npz, tmp_path / h, compressor=h, comm_triton=h == "spardl")
        for h in hooks
    ]
    records = launch(_run_many, 2, configs)
    # each run's process switch follows its config, whatever ran before it in the process
    assert [r["triton"] for r in records[0]] == [h == "spardl" for h in hooks]
    for hook in hooks:
        curve = _epoch_lines(tmp_path / hook)
        assert [r["epoch"] for r in curve] == [1, 2, 3, 4], hook
        assert curve[-1]["loss"] < curve[0]["loss"], (hook, [r["loss"] for r in curve])
        assert all(r["bytes_sent"] > 0 and r["workers"] == 2 for r in curve), hook
        assert set(curve[0]["seconds"]) == {"compute", "select", "communicate"}
    # a sparse hook sends far fewer bytes than the dense all-reduce
    dense, topk = _epoch_lines(tmp_path / "dense")[0], _epoch_lines(tmp_path / "topk")[0]
    assert topk["bytes_sent"] < 0.5 * dense["bytes_sent"]
    # the dense baseline each epoch reports is what the dense hook really sent
    assert dense["dense_bytes"] == pytest.approx(dense["bytes_sent"], rel=1e-9)
    assert topk["dense_bytes"] == pytest.approx(dense["dense_bytes"], rel=1e-9)
    assert dense["iterations"] == topk["iterations"] > 0
    # rank 0 says what it is doing as it goes: the phases, in order, and each epoch's start
    events = [json.loads(x) for x in (tmp_path / "dense" / METRICS).read_text().splitlines()]
    phases = [e["phase"] for e in events if e.get("event") == "progress"]
    changes = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert changes == ["loading data", *["training", "evaluating"] * 4, "saving the model"]
    # within an epoch of several steps: a sub-epoch point, rank 0's running loss so far
    points = [e for e in events if e.get("event") == "progress" and e.get("loss") is not None]
    assert points and 0 < points[0]["step"] < points[0]["steps"] and points[0]["epoch"] == 1
    assert points[0]["loss"] > 0 and 0 <= points[0]["train_acc"] <= 1


def _epoch_lines(run) -> list[dict]:
    """The run's epoch records (``metrics.jsonl`` also holds its progress events)."""
    lines = (run / METRICS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


def test_resume_continues_the_same_run_and_model_loads(tiny_zoo, tiny_npz, tmp_path):
    straight = _cfg(tiny_zoo, tiny_npz, tmp_path / "straight", compressor="topk", epochs=3)
    first = _cfg(tiny_zoo, tiny_npz, tmp_path / "split", compressor="topk", epochs=2)
    resumed = _cfg(tiny_zoo, tiny_npz, tmp_path / "split", compressor="topk", resume=True)
    resumed["epochs"] = 3
    launch(_run_many, 2, [straight, first, resumed])
    from zoopick.training.config import EpochRecord, RunEvent, parse_line

    def lines(run: str) -> list:
        records = map(parse_line, (tmp_path / run / METRICS).read_text().splitlines())
        return [
            r
            for r in records
            if not (isinstance(r, RunEvent) and r.event in ("progress", "recipe"))
        ]

    a, b = lines("straight"), lines("split")
    # the resumed run says where it continued from, between its epochs 2 and 3
    assert b[2] == RunEvent("resumed", epoch=2, workers=2)
    del b[2]
    assert all(isinstance(r, EpochRecord) for r in a + b) and len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert x.loss == pytest.approx(y.loss, rel=1e-5)
        assert x.test_accuracy == y.test_accuracy

    from safetensors.torch import load_file

    from zoopick.selection.zoo import load_zoo

    w1 = load_file(tmp_path / "straight" / FINAL_WEIGHTS)
    w2 = load_file(tmp_path / "split" / FINAL_WEIGHTS)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-6)
    meta = json.loads((tmp_path / "straight" / FINAL_CONFIG).read_text())
    assert meta["class_names"] == ["dark", "mid", "bright"]
    assert meta["data_config"]["input_size"] == [3, 32, 32]
    model = load_zoo(tiny_zoo)["tiny-resnet"].create_model(num_classes=meta["num_classes"])
    model.load_state_dict(w1)


def test_a_ranks_residuals_saved_at_another_point_start_from_zero(tmp_path):
    """``_restore`` loads a rank's residuals only when they were saved at the checkpoint's
    point (their ``at``): the store's uploader may pack a checkpoint with the residuals the
    next save wrote before its checkpoint. Untagged residuals (saved before the tag) load."""
    from zoopick.training import finetune
    from zoopick.training.comm import build
    from zoopick.training.config import CHECKPOINT

    cfg = FinetuneConfig(zoo="z", model="m", data="d", out=str(tmp_path), compressor="topk")
    model = torch.nn.Linear(3, 2)
    checkpoint = {"epoch": 2, "step": 5, "world": 1, "model": model.state_dict()}
    torch.save({**checkpoint, "config": cfg.model_dump(mode="json")}, tmp_path / CHECKPOINT)
    saved = {"iteration": 7, "residuals": {}, "momenta": {}, "scheme": {}}

    def iteration_after_restore(residuals: dict) -> int:
        torch.save(residuals, finetune.state_file(tmp_path, 0))
        state, _ = build(cfg.compressor, cfg.comm_hook())
        assert finetune._restore(tmp_path, cfg, model, state, 0, 1)[:2] == (2, 5)
        return state.iteration

    assert iteration_after_restore({**saved, "at": [2, 5]}) == 7
    assert iteration_after_restore({**saved, "at": [3, 0]}) == 0  # the next save's
    assert iteration_after_restore(saved) == 7


def test_config_rejects_bad_values():
    from pydantic import ValidationError

    where = {"zoo": "z", "model": "m", "data": "d", "out": "o"}
    with pytest.raises(ValidationError, match="density"):
        FinetuneConfig(**where, density=0)
    with pytest.raises(ValidationError, match="momentum twice"):
        FinetuneConfig(**where, optimizer="sgd", hook_options={"momentum": 0.9})
    with pytest.raises(ValidationError, match="Adam"):
        FinetuneConfig(**where, optimizer="adam", hook_options={"momentum": 0.5})
    with pytest.raises(ValidationError, match="teams"):
        FinetuneConfig(**where, compressor="spardl", hook_options={"teams": 0})
    with pytest.raises(ValidationError, match="density is set on its own"):
        FinetuneConfig(**where, hook_options={"density": 0.5})
    FinetuneConfig(**where, optimizer="sgd", momentum=0.0, hook_options={"momentum": 0.9})
    saved = FinetuneConfig(**where).model_dump(mode="json")
    assert FinetuneConfig(**where, lr=0.5).same_run(saved) == ["lr"]


def test_training_file_as_test_data_uses_its_test_split(tmp_path):
    import numpy as np

    from zoopick.training.finetune import _load_data

    rng = np.random.default_rng(0)
    path = tmp_path / "keras.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 255, (12, 8, 8), dtype=np.uint8),
        y_train=np.arange(12) % 3,
        x_test=rng.integers(0, 255, (6, 8, 8), dtype=np.uint8),
        y_test=np.arange(6) % 3,
    )
    cfg = FinetuneConfig(zoo="z", model="m", data=str(path), out="o", test_data=str(path))
    train, test, val = _load_data(cfg, 1)
    assert (len(train), len(test), val) == (12, 6, None)  # 4 a class: too few to hold out


def test_sparse_hooks_get_the_default_warmup_unless_the_run_sets_one():
    """A run that names no warm-up gets ``SPARSE_WARMUP`` iterations of DGC's exponential
    warm-up on a sparse hook (dense has none); an explicit ``warmup`` (0 included) is kept."""
    from zoopick.training.comm import build, make_hook
    from zoopick.training.config import SPARSE_WARMUP, FinetuneConfig

    def options(compressor: str, **hook_options):
        return FinetuneConfig(
            zoo="z", model="m", data="d", out="o", compressor=compressor,
            hook_options=hook_options,
        ).comm_options()  # fmt: skip

    assert options("spardl") == {"warmup": SPARSE_WARMUP}
    assert options("topk", fp16=True) == {"fp16": True, "warmup": SPARSE_WARMUP}
    assert options("spardl", warmup=0) == {"warmup": 0}
    assert options("dense") == {}
    state, _ = make_hook("spardl", density=0.01, **options("spardl"))
    assert [state.density_at(t) for t in range(5)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]

    # what the trainer builds: the run's typed hook options, the same schedule
    def run_hook(compressor: str):
        cfg = FinetuneConfig(zoo="z", model="m", data="d", out="o", compressor=compressor)
        return build(compressor, cfg.comm_hook())[0]

    state = run_hook("spardl")
    assert [state.density_at(t) for t in range(5)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert run_hook("dense").warmup == 0


def _diverging(rank: int, world: int, config: dict) -> str:
    from zoopick.training.finetune import Diverged

    try:
        run(FinetuneConfig(**config))
    except Diverged as exc:
        return str(exc)
    return "trained"


def test_a_run_whose_loss_is_not_finite_stops_and_writes_no_model(tiny_zoo, tiny_npz, tmp_path):
    """lr 10 with weight decay 1 (both within the options' bounds) drives the weights to
    infinity: the run used to end with exit 0, a saved model of NaNs and metrics holding bare
    NaN. Every rank sees the same all-reduced loss, so every rank stops."""
    out = tmp_path / "nan"
    config = _cfg(tiny_zoo, tiny_npz, out, compressor="dense", lr=10.0, weight_decay=1.0,
                  batch_size=2, epochs=6)  # fmt: skip
    results = launch(_diverging, 2, config)
    assert all("not finite" in r and "no model" in r for r in results), results
    assert not (out / FINAL_WEIGHTS).exists()
    for line in (out / METRICS).read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the metrics"))


def test_a_batch_of_one_is_refused_up_front():
    with pytest.raises(ValueError, match="batch_size"):
        FinetuneConfig(zoo="z", model="m", data="d", out="o", batch_size=1)


def _recipe_events(run) -> list[dict]:
    lines = (run / METRICS).read_text().splitlines()
    return [r["recipe"] for r in map(json.loads, lines) if r.get("event") == "recipe"]


def _real_and_permuted(tiny_npz, tmp_path) -> dict:
    """Two test files of the same images: the real labels and the labels rolled by 8 (what
    must play no part in the recipe's choices)."""
    data = np.load(tiny_npz)
    tests = {}
    for name, labels in (("real", data["y"]), ("permuted", np.roll(data["y"], 8))):
        tests[name] = tmp_path / f"test-{name}.npz"
        np.savez(tests[name], x=data["x"], y=labels, class_names=data["class_names"])
    return tests


def test_auto_recipe_searches_returns_its_best_checkpoint_and_never_reads_the_test_split(
    tiny_zoo, tiny_npz, tmp_path
):
    """Two auto runs that differ only in their test file's labels (real, then permuted)
    choose the same rate and step and return the same weights; the model returned scores its
    recorded best validation accuracy on the validation split; a resumed finished run
    neither searches again nor changes the model."""
    from safetensors.torch import load_file

    from zoopick.selection.data import load_dataset, split_dataset
    from zoopick.selection.extract import normalise, preprocess
    from zoopick.selection.zoo import load_zoo
    from zoopick.training import recipe

    tests = _real_and_permuted(tiny_npz, tmp_path)
    common = {"compressor": "spardl", "recipe": "auto", "lr": None, "optimizer": None}
    # 70 epochs of 4 steps (18 training images, 6 held out): 280 steps, each trial gets 22
    configs = [
        _cfg(tiny_zoo, tiny_npz, tmp_path / name, test_data=str(path), epochs=70, **common)
        for name, path in tests.items()
    ]
    configs.append(configs[0] | {"resume": True})
    launch(_run_kept, 1, configs)

    real, permuted = (tmp_path / "real", tmp_path / "permuted")
    [chosen], [chosen_b] = _recipe_events(real), _recipe_events(permuted)
    assert chosen["plan"]["lr_source"] == "search" and len(chosen["trials"]) >= 3
    assert chosen["lr"] in [t["lr"] for t in chosen["trials"]]
    for c in (chosen, chosen_b):
        assert c.pop("search_seconds") > 0  # a timing: the rest must be equal
    assert chosen == chosen_b  # the search's curve and choice: the test labels play no part
    final = json.loads((real / FINAL_CONFIG).read_text())["recipe"]
    final_b = json.loads((permuted / FINAL_CONFIG).read_text())["recipe"]
    final.pop("search_seconds"), final_b.pop("search_seconds")
    assert final["best_step"] is not None and final == final_b
    w_real, w_perm = load_file(real / FINAL_WEIGHTS), load_file(permuted / FINAL_WEIGHTS)
    assert all(torch.equal(w_real[k], w_perm[k]) for k in w_real)
    # a resumed run that had finished: no second search, the same best model
    assert len(_recipe_events(real)) == 1
    # the returned model is the best validation checkpoint: it scores that accuracy there
    train = load_dataset(tiny_npz, seed=0)
    share = recipe.validation_fraction(list(train.class_counts().values()))
    _, val = split_dataset(train, share, 0 + 1)
    entry = load_zoo(tiny_zoo)["tiny-resnet"]
    model = entry.create_model(num_classes=3)
    model.load_state_dict(w_real)
    model.eval()
    cfg = entry.data_config(model)
    with torch.inference_mode():
        pred = model(normalise(preprocess(val, cfg), cfg, "cpu")).argmax(1).numpy()
    assert float((pred == val.labels).mean()) == pytest.approx(final["best_val_accuracy"])
    epochs = _epoch_lines(real)
    assert epochs[-1]["val_acc"] == pytest.approx(final["best_val_accuracy"])


def _run_kept(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """:func:`_run_many` with the validation share kept out of training at any size (a
    large split's rules: the best validation checkpoint), on this test's small data."""
    from zoopick.training import recipe

    recipe.REFIT_BELOW = None
    return _run_many(rank, world, configs)


def _run_refit(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """:func:`_run_many` with the recipe's refit rule on for any split (rules 6)."""
    from zoopick.training import recipe

    recipe.REFIT_BELOW = 10**6
    return _run_many(rank, world, configs)


def test_a_refit_run_chooses_its_rate_on_the_share_then_trains_on_every_image(
    tiny_zoo, tiny_npz, tmp_path
):
    """Rules 6: the rate is searched on the validation share, then every training image
    trains (an epoch is the file's 24 images' 6 steps, not the kept images' 4) and the last
    weights are returned; the test labels play no part (a permuted test file gives the same
    choices and weights); a resumed finished run neither searches nor trains again."""
    from safetensors.torch import load_file

    tests = _real_and_permuted(tiny_npz, tmp_path)
    common = {"compressor": "dense", "recipe": "auto", "lr": None, "optimizer": None}
    configs = [
        _cfg(tiny_zoo, tiny_npz, tmp_path / name, test_data=str(path), epochs=70, **common)
        for name, path in tests.items()
    ]
    configs.append(configs[0] | {"resume": True})
    launch(_run_refit, 1, configs)

    real, permuted = tmp_path / "real", tmp_path / "permuted"
    [chosen], [chosen_b] = _recipe_events(real), _recipe_events(permuted)
    assert chosen["plan"]["refit"] and chosen["plan"]["lr_source"] == "search"
    assert len(chosen["trials"]) >= 3 and chosen["plan"]["validation_fraction"] > 0
    # each trial's loss carries its paired standard error to the lowest one (0 for that one)
    errors = sorted(t["loss_se"] for t in chosen["trials"])
    assert errors[0] == 0.0 and all(e > 0 for e in errors[1:])
    for c in (chosen, chosen_b):
        c.pop("search_seconds")
    assert chosen == chosen_b
    curve = _epoch_lines(real)
    assert [r["steps"] for r in curve[:2]] == [6, 12]  # 24 images at batch 4: every image
    assert curve[-1]["steps"] == chosen["plan"]["steps"] == 420  # no early stop
    assert all(r.get("val_acc") is None for r in curve)  # no checks after the search
    final = json.loads((real / FINAL_CONFIG).read_text())["recipe"]
    assert final["best_step"] is None and not final["stopped_early"]
    w_real, w_perm = load_file(real / FINAL_WEIGHTS), load_file(permuted / FINAL_WEIGHTS)
    assert all(torch.equal(w_real[k], w_perm[k]) for k in w_real)
    assert len(_recipe_events(real)) == 1 and len(_epoch_lines(real)) == len(curve)


def test_the_trainer_loads_its_data_under_the_runs_dataset_limits(tiny_zoo, tiny_npz, tmp_path):
    """A job's run carries the deployment's dataset limits (the ones that validated the
    dataset), and the trainer loads under them, not the library's defaults."""
    from zoopick.selection.limits import LimitExceeded
    from zoopick.training.finetune import _load_data

    cfg = FinetuneConfig(**_cfg(tiny_zoo, tiny_npz, tmp_path / "run"))
    train, test, _ = _load_data(cfg, 1)
    assert len(train) + len(test) == 24  # the defaults: the whole file
    bounded = cfg.model_copy(update={"dataset_limits": {"max_members": 5}})
    with pytest.raises(LimitExceeded, match="max_members"):
        _load_data(bounded, 1)


def test_the_trainer_reads_the_images_validation_decoded(tiny_zoo, tiny_imagefolder, tmp_path):
    """A job's run names the copy validation decoded: the trainer reads its images there (the
    file itself is never opened) and gets the loader's dataset; without a usable copy it reads
    the file."""
    from zoopick.selection import decoded
    from zoopick.selection.data import load_dataset
    from zoopick.training.finetune import _load_data

    assert decoded.write(load_dataset(tiny_imagefolder), tmp_path / "decoded", max_bytes=None)
    cfg = FinetuneConfig(**_cfg(tiny_zoo, tiny_imagefolder, tmp_path / "run"))
    from_file = _load_data(cfg, 1)
    gone = cfg.model_copy(
        update={"data": str(tmp_path / "deleted"), "decoded": str(tmp_path / "decoded")}
    )
    from_copy = _load_data(gone, 1)
    for a, b in zip(from_file[:2], from_copy[:2], strict=True):
        assert a.digest == b.digest and list(a.labels) == list(b.labels)
        assert all(
            np.array_equal(np.asarray(a.image(i)), np.asarray(b.image(i))) for i in range(len(a))
        )
    missing = cfg.model_copy(update={"decoded": str(tmp_path / "none")})
    assert _load_data(missing, 1)[0].digest == from_file[0].digest


def _paired(rank: int, world: int, new: list[float], old: list[float]) -> dict:
    """This rank's half of two trials' per-image losses through the trainer's pairing."""
    from zoopick.training.finetune import _paired_errors

    half = len(new) // world
    mine = slice(rank * half, (rank + 1) * half)
    mine_new, mine_old = (torch.tensor(v[mine], dtype=torch.float64) for v in (new, old))
    return _paired_errors(mine_new, {1e-3: mine_old}, torch.device("cpu"))


def test_the_searchs_paired_error_is_the_standard_error_of_the_per_image_differences():
    """Two ranks each hold half of a validation share's per-image losses for two trials: the
    error they agree on is numpy's ``std(d, ddof=1) / sqrt(n)`` of the 40 differences."""
    rng = np.random.default_rng(3)
    old = rng.gamma(2.0, 0.8, size=40)
    new = old + rng.normal(0.1, 0.3, size=40)  # correlated, as two trials on the same images
    results = launch(_paired, 2, new.tolist(), old.tolist())
    d = new - old
    expected = float(np.std(d, ddof=1) / np.sqrt(len(d)))
    assert [r[1e-3] for r in results] == pytest.approx([expected, expected], rel=1e-9)
    # unpaired, the error would be far larger: the pairing is what the rule counts on
    assert expected < 0.5 * float(np.sqrt(np.var(new, ddof=1) / 40 + np.var(old, ddof=1) / 40))


def test_the_searchs_paired_error_over_one_image_is_infinite():
    """One image has no spread to measure: no difference between two trials counts as real."""
    assert launch(_paired, 1, [1.0], [0.5]) == [{1e-3: math.inf}]
