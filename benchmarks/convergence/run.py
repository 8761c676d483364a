"""Does sparse communication cost accuracy? Fine-tune with every hook at 1 % density vs dense.

Each hook runs the real trainer (``zoopick.training.finetune`` under
``zoopick.training.launch.spawn_local``:
``torchrun --standalone``, P gloo processes on this machine) for the same fixed budget: the same
model and initialisation (a timm architecture from a zoo manifest written to a temp dir,
``weights: "none"`` = seeded random init, input 3x32x32), the same Fashion-MNIST subset, the
same optimizer, batches and epochs; only the communication hook differs. The test set is the
npz's ``x_test``/``y_test`` (``--test-per-class`` images a class), written with the training
subset to temp npz files for the runner.

Goal (reported met / not met): final test accuracy of ``spardl`` and ``topk`` within 1 point
of ``dense``.

    python benchmarks/convergence/run.py --data ../shared/datasets/fashion-mnist.npz
    python benchmarks/convergence/run.py --data ../shared/datasets/fashion-mnist.npz \
        --max-per-class 40 --test-per-class 20 --epochs 1 --hooks dense,topk --out /tmp/conv

Writes ``convergence.json``, ``convergence.md`` and ``convergence.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.selection.zoo import write_zoo  # noqa: E402
from zoopick.training.config import FinetuneConfig  # noqa: E402
from zoopick.training.launch import epoch_records, spawn_local  # noqa: E402

HOOKS = ("dense", "topk", "gaussiank", "spardl", "spardl-t2", "exdyna", "dfs")
# not run by default: spardl with 4-byte pairs (16-bit block-relative index + 16-bit value)
PAIRS16_LABELS = {"spardl-p16": "fp16", "spardl-p16bf": "bf16"}
GOAL_HOOKS = ("spardl", "topk")
GOAL_POINTS = 1.0
FMNIST_CLASSES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="fashion-mnist.npz (Keras layout)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--hooks",
        default=",".join(HOOKS),
        help="subset of " + ",".join((*HOOKS, *PAIRS16_LABELS)),
    )
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--arch", default="test_resnet", help="timm architecture (random init)")
    ap.add_argument(
        "--pretrained",
        default=None,
        metavar="ZOO_JSON:MODEL_ID",
        help="fine-tune this zoo model (its checkpoint, e.g. of benchmarks/transfer/zoo) "
        "instead of a random init of --arch",
    )
    ap.add_argument(
        "--classes",
        default=None,
        help="Fashion-MNIST classes to keep, e.g. 6,7,8,9 (the transfer zoo's held-out ones)",
    )
    ap.add_argument("--max-per-class", type=int, default=600, help="training images a class")
    ap.add_argument("--test-per-class", type=int, default=200, help="test images a class")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--momentum", type=float, default=0.9, help="optimizer momentum (sgd)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="sparse hooks: iterations of warm-up (DGC-style; 0 = none)",
    )
    ap.add_argument("--warmup-mode", choices=("exp", "dense"), default="exp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dense-seeds",
        default="1,2",
        help="extra dense runs with these seeds (other head init, data subset and batch "
        "order; same test images) to show run-to-run noise; empty for none",
    )
    ap.add_argument(
        "--spardl-seeds",
        default="1,2",
        help="extra spardl runs with these seeds (like --dense-seeds), so spardl and dense "
        "have as many seeds each for the seed-spread goal; empty for none",
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per hook")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    args.hooks = [h for h in args.hooks.split(",") if h]
    args.dense_seeds = [int(v) for v in args.dense_seeds.split(",") if v.strip()]
    args.spardl_seeds = [int(v) for v in args.spardl_seeds.split(",") if v.strip()]
    bad = sorted(set(args.hooks) - set(HOOKS) - set(PAIRS16_LABELS))
    if bad:
        ap.error(f"unknown hooks {bad}; choose from {', '.join((*HOOKS, *PAIRS16_LABELS))}")
    return args


def model_id(args: argparse.Namespace) -> str:
    return args.pretrained.rsplit(":", 1)[1] if args.pretrained else f"{args.arch}-random"


def pretrained_entry(spec: str) -> dict[str, Any]:
    """The manifest entry ``MODEL_ID`` of ``ZOO_JSON`` with an absolute checkpoint path."""
    from zoopick.selection.zoo import entry_to_dict, load_zoo

    path, _, mid = spec.rpartition(":")
    entry = load_zoo(path)[mid]
    item = entry_to_dict(entry)  # no root: the checkpoint path stays absolute
    return item


def write_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """(zoo.json, train.npz, test.npz, facts): the zoo manifest with one random-init model,
    the full training split (the runner keeps ``max_per_class`` of it, seeded) and a seeded
    per-class subset of the test split, both with the class names."""
    with np.load(args.data) as npz:
        x_train, y_train = npz["x_train"], npz["y_train"]
        x_test, y_test = npz["x_test"], npz["y_test"]
    classes = int(max(y_train.max(), y_test.max())) + 1
    names = np.array(FMNIST_CLASSES if classes == 10 else [str(c) for c in range(classes)])
    if args.classes:  # keep these classes, relabelled 0..k-1
        kept = [int(c) for c in args.classes.split(",")]
        remap = np.full(classes, -1)
        remap[kept] = np.arange(len(kept))
        tr, te = np.isin(y_train, kept), np.isin(y_test, kept)
        x_train, y_train = x_train[tr], remap[y_train[tr]]
        x_test, y_test = x_test[te], remap[y_test[te]]
        names, classes = names[kept], len(kept)
    rng = np.random.default_rng(args.seed)
    keep = np.concatenate(
        [
            rng.permutation(np.flatnonzero(y_test == c))[: args.test_per_class]
            for c in range(classes)
        ]
    )
    keep.sort()
    train_path, test_path = tmp / "train.npz", tmp / "test.npz"
    np.savez(train_path, x=x_train, y=y_train, class_names=names)
    np.savez(test_path, x=x_test[keep], y=y_test[keep], class_names=names)
    entry = pretrained_entry(args.pretrained) if args.pretrained else None
    zoo = write_zoo(
        [entry]
        if entry
        else [
            {
                "id": f"{args.arch}-random",
                "arch": args.arch,
                "weights": "none",
                "num_classes": classes,
                "input_size": [3, 32, 32],
                "mean": [0.5, 0.5, 0.5],
                "std": [0.5, 0.5, 0.5],
                "interpolation": "bilinear",
                "crop_pct": 1.0,
                "source": "random init (seeded from the id)",
            }
        ],
        tmp / "zoo" / "zoo.json",
    )
    facts = {
        "classes": classes,
        "train_available": int(len(y_train)),
        "train_used": int(
            sum(min(args.max_per_class, int((y_train == c).sum())) for c in range(classes))
        ),
        "test_used": int(len(keep)),
    }
    return zoo, train_path, test_path, facts


def hook_config(hook: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(compressor, hook options) for a benchmark label."""
    if hook == "dense":
        return "dense", {}
    options: dict[str, Any] = {}
    name = hook
    if hook.startswith("spardl-t"):
        name, options["teams"] = "spardl", int(hook[len("spardl-t") :])
    if hook in PAIRS16_LABELS:
        name, options["pairs16"] = "spardl", PAIRS16_LABELS[hook]
    if args.warmup:
        options.update(warmup=args.warmup, warmup_mode=args.warmup_mode)
    return name, options


def run_hook(
    hook: str, args, zoo: Path, train: Path, test: Path, out: Path, seed: int
) -> dict[str, Any]:
    compressor, options = hook_config(hook, args)
    cfg = FinetuneConfig(
        zoo=str(zoo),
        model=model_id(args),
        data=str(train),
        test_data=str(test),
        out=str(out),
        max_per_class=args.max_per_class,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        optimizer=args.optimizer,
        compressor=compressor,
        density=args.density,
        hook_options=options,
        seed=seed,
        workers=args.workers,
    )
    t0 = time.time()
    proc = spawn_local(cfg)
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    drain.start()
    timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    epochs = []
    try:
        for record in epoch_records(proc):
            epochs.append(record.to_dict())
            print(
                f"  {hook:<10} epoch {record.epoch}: loss {record.loss:.3f} "
                f"test {record.test_accuracy * 100:.2f}% ({time.time() - t0:.0f} s)",
                flush=True,
            )
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        drain.join(timeout=5)
    result: dict[str, Any] = {
        "hook": hook,
        "seed": seed,
        "compressor": compressor,
        "options": options,
        "epochs": epochs,
        "wall_s": round(time.time() - t0, 1),
        "returncode": rc,
    }
    if rc != 0 or len(epochs) != args.epochs:
        result["error"] = "".join(stderr)[-3000:]
        print(f"  {hook}: failed (rc {rc})\n{result['error']}", file=sys.stderr, flush=True)
    return result


def tail_mean(run: dict[str, Any], last: int = 3) -> float:
    """Mean test accuracy of the last ``last`` epochs (less noisy than the final epoch)."""
    accs = [e["test_acc"] for e in run["epochs"][-last:]]
    return sum(accs) / len(accs)


def goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The goal on the final epoch, and the same comparison on the mean of the last three
    epochs as a check on how much the verdict owes to the last epoch's noise."""
    out = []
    dense = runs.get("dense")
    ok_dense = bool(dense and dense.get("epochs") and "error" not in dense)
    for hook in GOAL_HOOKS:
        run = runs.get(hook)
        goal = f"{hook} final test accuracy within {GOAL_POINTS:g} point of dense"
        if not ok_dense or not run or not run.get("epochs") or "error" in run:
            out.append({"goal": goal, "met": None, "detail": "not measured"})
            continue
        base, acc = dense["epochs"][-1]["test_acc"], run["epochs"][-1]["test_acc"]
        gap = (acc - base) * 100
        tail_gap = (tail_mean(run) - tail_mean(dense)) * 100
        out.append(
            {
                "goal": goal,
                "met": gap >= -GOAL_POINTS,
                "detail": f"{acc * 100:.2f}% vs dense {base * 100:.2f}% ({gap:+.2f} points); "
                f"mean of the last 3 epochs: {tail_gap:+.2f} points",
                "gap_points": gap,
                "tail3_gap_points": tail_gap,
            }
        )
    out += seed_spread_goals(runs)
    return out


def _family(runs: dict[str, dict[str, Any]], hook: str) -> dict[str, dict[str, Any]]:
    return {
        h: r
        for h, r in runs.items()
        if (h == hook or h.startswith(f"{hook}-seed")) and r.get("epochs") and "error" not in r
    }


def seed_spread_goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """spardl's seeds against dense's: the mean final accuracy of spardl's seeds inside the
    range dense's seeds span (and the same on last-3-epoch means)."""
    dense, sparse = _family(runs, "dense"), _family(runs, "spardl")
    goal = "spardl (all seeds) final test accuracy within the dense seed spread"
    if len(dense) < 2 or len(sparse) < 2:
        return [{"goal": goal, "met": None, "detail": "needs >= 2 seeds of each"}]
    d = [r["epochs"][-1]["test_acc"] * 100 for r in dense.values()]
    sp = [r["epochs"][-1]["test_acc"] * 100 for r in sparse.values()]
    d3 = [tail_mean(r) * 100 for r in dense.values()]
    s3 = [tail_mean(r) * 100 for r in sparse.values()]
    m, m3 = sum(sp) / len(sp), sum(s3) / len(s3)
    return [
        {
            "goal": goal,
            "met": min(d) <= m <= max(d) or m > max(d),
            "detail": f"spardl {len(sp)} seeds: {', '.join(f'{v:.2f}' for v in sp)} (mean "
            f"{m:.2f}%); dense {len(d)} seeds: {min(d):.2f}-{max(d):.2f}%. Last-3 means: "
            f"spardl {m3:.2f}% vs dense {min(d3):.2f}-{max(d3):.2f}%",
        }
    ]


def markdown(result: dict[str, Any]) -> str:
    a = result["settings"]
    runs = result["runs"]
    lines = [
        "# Convergence benchmark",
        "",
        (
            f"Fine-tuning the pretrained zoo model `{a['pretrained']}` on Fashion-MNIST "
            f"classes {a['classes']} "
            if a.get("pretrained")
            else f"Fine-tuning `{a['arch']}` (random init, 3x32x32) on Fashion-MNIST "
        )
        + f"({result['data']['train_used']} training images = {a['max_per_class']} a class, "
        f"{result['data']['test_used']} test images from the test split) with P = "
        f"{a['workers']} gloo workers on {result['machine']['cpus']} CPUs, "
        f"{a['epochs']} epochs, {a['optimizer']} lr {a['lr']:g}"
        + (f" momentum {a['momentum']:g}" if a["optimizer"] == "sgd" else "")
        + f", batch {a['batch_size']} per worker; sparse hooks at density {a['density']:g}, "
        + (
            f"warm-up {a['warmup']} iterations ({a['warmup_mode']})."
            if a["warmup"]
            else "no warm-up."
        ),
        "Every run starts from the same weights and sees the same batches; only the hook "
        "differs. `dense-seedN` rows are dense again with another seed (head init, training "
        "subset, batch order; same test images): how far two runs of the same method land "
        "apart, the noise to read the gaps against.",
        "",
        f"Run {result['started']}, {result['wall_s'] / 60:.1f} min wall; "
        f"command: `{result['command']}`",
        "",
        "## Goals",
        "",
        "| goal | verdict | detail |",
        "|---|---|---|",
    ]
    for g in result["goals"]:
        verdict = "not measured" if g["met"] is None else ("**met**" if g["met"] else "**not met**")
        lines.append(f"| {g['goal']} | {verdict} | {g['detail']} |")
    dense = runs.get("dense")
    base = dense["epochs"][-1] if dense and dense.get("epochs") else None
    family = {h: r for h, r in runs.items() if h.startswith("dense") and r.get("epochs")}
    if len(family) > 1:
        finals = {h: r["epochs"][-1]["test_acc"] * 100 for h, r in family.items()}
        tails = {h: tail_mean(r) * 100 for h, r in family.items()}
        lines += [
            "",
            f"Noise floor: dense with {len(family)} seeds ends at "
            + ", ".join(f"{v:.2f}%" for v in finals.values())
            + f" (spread {max(finals.values()) - min(finals.values()):.2f} points; last-3 "
            f"means spread {max(tails.values()) - min(tails.values()):.2f} points).",
        ]
    lines += [
        "",
        "## Results",
        "",
        "| hook | final test acc | vs dense (points) | last-3 mean | vs dense | best test acc "
        "| final loss | "
        "bytes sent / worker / epoch (MB) | vs dense | compute / select / comm s (last epoch) "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for hook, run in runs.items():
        if not run.get("epochs"):
            lines.append(f"| {hook} | failed | | | | | | | | | {run['wall_s']} |")
            continue
        last = run["epochs"][-1]
        best = max(e["test_acc"] for e in run["epochs"])
        gap = "" if base is None else f"{(last['test_acc'] - base['test_acc']) * 100:+.2f}"
        t3 = tail_mean(run)
        t3_gap = "" if base is None else f"{(t3 - tail_mean(dense)) * 100:+.2f}"
        ratio = "" if base is None else f"{last['bytes_sent'] / base['bytes_sent']:.3f}"
        s = last["seconds"]
        lines.append(
            f"| {hook} | {last['test_acc'] * 100:.2f}% | {gap} | {t3 * 100:.2f}% | {t3_gap} | "
            f"{best * 100:.2f}% | "
            f"{last['loss']:.3f} | {last['bytes_sent'] / 1e6:.2f} | {ratio} | "
            f"{s['compute']:.1f} / {s['select']:.1f} / {s['communicate']:.1f} | {run['wall_s']} |"
            + (" (incomplete)" if "error" in run else "")
        )
    lines += [
        "",
        "## Test accuracy per epoch (%)",
        "",
        "| hook | " + " | ".join(f"{e + 1}" for e in range(a["epochs"])) + " |",
        "|---|" + "---|" * a["epochs"],
    ]
    for hook, run in runs.items():
        accs = [f"{e['test_acc'] * 100:.1f}" for e in run.get("epochs", [])]
        accs += [""] * (a["epochs"] - len(accs))
        lines.append(f"| {hook} | " + " | ".join(accs) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for hook, run in result["runs"].items():
        eps = run.get("epochs", [])
        if eps:
            ax.plot(
                [e["epoch"] for e in eps],
                [e["test_acc"] * 100 for e in eps],
                marker="o",
                lw=2.5 if hook == "dense" else 1.5,
                color="black"
                if hook == "dense"
                else ("grey" if hook.startswith("dense") else None),
                ls="--" if hook.startswith("dense-seed") else "-",
                label=hook,
            )
    a = result["settings"]
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        f"Fashion-MNIST, {a['arch']}, P={a['workers']}, density {a['density']:g}"
        + (f", warm-up {a['warmup']}" if a["warmup"] else "")
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.data.exists():
        print(f"dataset not found: {args.data}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="zp_conv_") as tmp_name:
        tmp = Path(tmp_name)
        zoo, train, test, facts = write_inputs(args, tmp)
        for hook in args.hooks:
            print(f"{hook}: {args.workers} workers, {args.epochs} epochs", flush=True)
            runs[hook] = run_hook(hook, args, zoo, train, test, tmp / "runs" / hook, args.seed)
        for seed in args.dense_seeds:
            label = f"dense-seed{seed}"
            print(f"{label}: run-to-run noise of dense", flush=True)
            runs[label] = run_hook("dense", args, zoo, train, test, tmp / "runs" / label, seed)
        if "spardl" in args.hooks:
            for seed in args.spardl_seeds:
                label = f"spardl-seed{seed}"
                print(f"{label}: spardl with another seed", flush=True)
                out_dir = tmp / "runs" / label
                runs[label] = run_hook("spardl", args, zoo, train, test, out_dir, seed)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {
        "settings": settings,
        "data": facts,
        "command": " ".join(["python benchmarks/convergence/run.py", *(sys.argv[1:] or [])])
        if argv is None
        else " ".join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": __import__("torch").__version__,
        },
        "runs": runs,
    }
    result["goals"] = goals(runs)
    (args.out / "convergence.json").write_text(json.dumps(result, indent=1))
    (args.out / "convergence.md").write_text(markdown(result))
    try:
        plot(result, args.out / "convergence.png")
    except ImportError:  # matplotlib is optional: the tables carry the numbers
        print("no convergence.png: matplotlib is not installed", flush=True)
    print(f"wrote {args.out / 'convergence.json'} ({time.time() - started:.0f} s)", flush=True)
    failed = [h for h, r in runs.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
