"""``run.py --mode iteration``: launches, summary, goals and ``comm_iteration.{json,md}``.

What a hook *adds* to a training iteration is the median whole-iteration time (forward +
backward with the hook inside, slowest rank) minus the same for torch's ``noop_hook`` in the
same launch (same P, link, model, inputs). Ratios are taken within one launch only.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.comm import cpushare, netns  # noqa: E402
from zoopick.training.comm import message_steps, spardl_schedule  # noqa: E402

PAIR_BYTES = 8  # int32 index + float32 value


def summarise(P: int, link: str, rate: int | None, ranks: list[dict]) -> list[dict[str, Any]]:
    out = []
    numel = ranks[0]["numel"]
    for c, cfg in enumerate(ranks[0]["configs"]):
        per_rank = [r["configs"][c] for r in ranks]
        n_it = min(len(pr["iters"]) for pr in per_rank)

        def med(key: str, agg, per_rank=per_rank, n_it=n_it) -> float | None:
            if key not in per_rank[0]["iters"][0]:
                return None
            return median(agg([pr["iters"][i][key] for pr in per_rank]) for i in range(n_it))

        zeros = [pr["zero_fraction"] for pr in per_rank if pr["zero_fraction"] is not None]
        out.append(
            {
                "link": link,
                "link_mbit": rate,
                "P": P,
                "hook": cfg["hook"],
                "density": cfg["density"],
                "numel": numel,
                "iters": n_it,
                "time_s": med("wall_s", max),
                "time_s_iters": [
                    max(pr["iters"][i]["wall_s"] for pr in per_rank) for i in range(n_it)
                ],
                "cpu_s": med("cpu_s", max),
                "select_s": med("select_s", mean),
                "comm_s": med("comm_s", mean),
                "bytes_sent": med("bytes_sent", mean),
                "wire_tx": mean(pr["wire_tx_per_iter"] for pr in per_rank),
                "wire_tx_max": max(pr["wire_tx_per_iter"] for pr in per_rank),
                "zero_fraction": mean(zeros) if zeros else None,
                # block selections over the timed iterations, all ranks (cpu_kernels.COUNTS)
                "kernel_counts": {
                    key: sum(pr.get("kernel_counts", {}).get(key, 0) for pr in per_rank)
                    for key in ("kernel", "fallback")
                },
            }
        )
    noop = next((r for r in out if r["hook"] == "noop"), None)
    for r in out:
        r["added_s"] = None if noop is None else r["time_s"] - noop["time_s"]
        if noop is not None and rate:
            # one core per worker, estimated: the extra CPU seconds of the slowest worker plus
            # the measured wire bytes at the link rate (this machine has fewer cores than P)
            wire = max(r["wire_tx_max"] - noop["wire_tx_max"], 0.0) * 8 / (rate * 1e6)
            r["added_1core_est_s"] = max(r["cpu_s"] - noop["cpu_s"], 0.0) + wire
        else:
            r["added_1core_est_s"] = None
    return out


WALL_KEYS = ("time_s", "select_s", "comm_s", "added_s")


def dilate(records: list[dict[str, Any]], share: float) -> None:
    """Scale the wall times of a ``--share-cores`` launch (each worker on ``share`` of a
    core, links at ``share`` of their rate) back to one core per worker at the full rate.
    CPU seconds and bytes are not dilated and stay as they are."""
    for r in records:
        r["dilation"] = share
        for key in WALL_KEYS:
            if r.get(key) is not None:
                r[key] *= share
        r["time_s_iters"] = [t * share for t in r["time_s_iters"]]


def goals(records: list[dict[str, Any]], density: float = 0.01) -> list[dict[str, Any]]:
    by = {(r["link"], r["P"], r["hook"], r["density"]): r for r in records}
    links = sorted({r["link"] for r in records})
    out = []

    def get(link, P, hook):
        return by.get((link, P, hook, None if hook in ("noop", "dense", "powersgd") else density))

    for link in links:
        Ps = sorted({r["P"] for r in records if r["link"] == link})
        sp4, de4 = get(link, 4, "spardl"), get(link, 4, "dense")
        if sp4 and de4 and sp4["added_s"] is not None:
            ratio = de4["added_s"] / sp4["added_s"] if sp4["added_s"] > 0 else math.inf
            est = None
            if sp4["added_1core_est_s"]:
                est = de4["added_1core_est_s"] / sp4["added_1core_est_s"]
            detail = (
                f"dense adds {de4['added_s'] * 1e3:.0f} ms, spardl {sp4['added_s'] * 1e3:.0f} ms:"
                f" {ratio:.2f}x" + (f" (one core per worker, estimated: {est:.2f}x)" if est else "")
            )
            out.append(
                {
                    "goal": f"{link}, P=4, density 1%: spardl adds >= 10x less than dense",
                    "met": ratio >= 10,
                    "detail": detail,
                }
            )
        rows = []
        met = True
        for P in Ps:
            sp = get(link, P, "spardl")
            if not sp:
                continue
            cells = []
            for other in ("topk", "gaussiank", "powersgd"):
                o = get(link, P, other)
                if o is None:
                    cells.append(f"{other} n/a")
                    continue
                ok = sp["added_s"] < o["added_s"]
                met &= ok
                cells.append(f"{other} {o['added_s'] * 1e3:.0f}{'' if ok else ' (!)'}")
            rows.append(f"P={P}: spardl {sp['added_s'] * 1e3:.0f} ms vs " + ", ".join(cells))
        if rows:
            out.append(
                {
                    "goal": f"{link}, density 1%: spardl adds less than topk, gaussiank and "
                    "powersgd (rank 4) at every P measured",
                    "met": met,
                    "detail": "; ".join(rows),
                }
            )
        worst = 0.0
        for r in records:
            if r["link"] == link and r["hook"] == "spardl" and r["bytes_sent"]:
                ideal = 2 * r["density"] * r["numel"] * (r["P"] - 1) / r["P"] * PAIR_BYTES
                worst = max(worst, r["bytes_sent"] / ideal)
        if worst:
            out.append(
                {
                    "goal": f"{link}: spardl bytes (hook count) within 1.1x of 2k(P-1)/P pairs",
                    "met": worst <= 1.1,
                    "detail": f"worst ratio {worst:.3f}",
                }
            )
    steps = {P: message_steps(spardl_schedule(P)) for P in range(2, 17)}
    ok = all(s == math.ceil(math.log2(P)) for P, s in steps.items())
    out.append(
        {
            "goal": "spardl: ceil(log2 P) message steps on the slowest worker, P = 2..16",
            "met": ok,
            "detail": ", ".join(f"P={P}: {s}" for P, s in steps.items()),
        }
    )
    return out


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.0f}"


def markdown(result: dict[str, Any]) -> str:
    recs = result["records"]
    run = result["runs"][0]
    lines = [
        "# Whole-iteration benchmark (realistic gradient)",
        "",
        "Recipe: timm resnet18, `zero_init_last=False`, same random weights on every rank, "
        f"{run['batch']} random images of {run['px']}x{run['px']} px per rank and iteration, "
        "DDP default buckets, gloo, one torch thread per process, each worker in its own "
        "network namespace with `tc tbf` egress shaping. Time = median over timed iterations "
        "of the slowest rank's forward + backward (the hook runs inside backward); *added* = "
        "that minus torch's `noop_hook` in the same launch. *select* / *comm* are the hook's "
        "own seconds (mean over ranks); *hook bytes* its own count per worker and iteration; "
        "*wire bytes* what the worker's veth really sent per iteration (payload + TCP/IP "
        "headers + barriers; mean over ranks). "
        + (
            f"Time dilation (`--share-cores {run['share_cores']}`): each worker ran in a "
            "cgroup with a CFS quota of f = 1/ceil(P/N) of one core (1 ms per 1/f ms), "
            "pinned so no core carried more than 1/f workers, with its link shaped to f times "
            "the nominal rate; every wall time in the tables (iteration, *added*, *select*, "
            "*comm*) is multiplied by f, so *added* emulates one core per worker at the "
            "nominal rate (CPU seconds and bytes are not dilated). The *one core (est.)* "
            "column is the other estimate (the slowest worker's extra CPU seconds vs noop "
            "plus the extra wire bytes at the link rate), kept beside it as a check."
            if run.get("share_cores") is not None
            else f"Each worker is pinned to a core of its own (`--pin-from {run['pin_from']}`, "
            f"{run['cpus']} cores): *added* is measured with one core per worker. The *one "
            "core (est.)* column is the estimate used where cores are shared (the slowest "
            "worker's extra CPU seconds vs noop plus the extra wire bytes at the link rate), "
            "kept beside it as a check of that estimate."
            if run.get("pin_from") is not None
            else "The *one core* column is an estimate, not a "
            f"measurement: this machine has {run['cpus']} cores shared with other jobs, so "
            "for P > 2 workers share cores; it adds the slowest worker's extra CPU seconds "
            "(vs noop) and the extra wire bytes at the link rate."
        ),
        "",
        "Runs (each (P, link) is one launch; *added* always uses the noop of the same "
        "launch, so a merged run's rows carry their own baseline):",
        "",
    ]
    for r in result["runs"]:
        lines.append(
            f"- `{' '.join(r['argv'])}`: {r['wall_s'] / 60:.1f} min, load average "
            f"{r['loadavg_before']} before, {r['loadavg_after']} after"
        )
    lines += [
        "",
        "The numbers are noisy (2 cores shared with other jobs): read ratios within a launch.",
        "",
    ]
    zeros = [r["zero_fraction"] for r in recs if r["zero_fraction"] is not None]
    if zeros:
        lines += [
            f"Zero fraction of the local gradient (noop iteration): {min(zeros):.4f} to "
            f"{max(zeros):.4f} over the launches (not degenerate).",
            "",
        ]
    lines += ["## Goals", "", "| goal | verdict | detail |", "|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | **{'met' if g['met'] else 'not met'}** | {g['detail']} |")
    for link in sorted({r["link"] for r in recs}):
        lines += [
            "",
            f"## {link}",
            "",
            "| P | hook | density | iteration ms | added ms | select ms | comm ms | "
            "hook MB | wire MB | added, one core (est.) ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in recs:
            if r["link"] != link:
                continue
            hb = "—" if r["bytes_sent"] is None else f"{r['bytes_sent'] / 1e6:.2f}"
            lines.append(
                f"| {r['P']} | {r['hook']} | {r['density'] or '—'} | {_ms(r['time_s'])} | "
                f"{_ms(r['added_s'])} | {_ms(r['select_s'])} | {_ms(r['comm_s'])} | {hb} | "
                f"{r['wire_tx'] / 1e6:.2f} | {_ms(r['added_1core_est_s'])} |"
            )
    return "\n".join(lines) + "\n"


def main(args, launch, configs_for) -> int:
    out_json = args.out / "comm_iteration.json"
    if args.report_only:
        result = json.loads(out_json.read_text())
    else:
        started = time.time()
        ok, why = (False, "--loopback given") if args.loopback else netns.available()
        links = [(f"{r}mbit", r) for r in args.links] if ok else [("loopback", None)]
        load_before = os.getloadavg()
        records: list[dict[str, Any]] = []
        errors = []
        for link, rate in links:
            for P in args.workers:
                configs = configs_for(P, args.hooks, args.densities)
                # PowerSGD last: its gloo callbacks are the one hang risk seen in this project
                configs.sort(key=lambda c: c[0] == "powersgd")
                t0 = time.time()
                print(f"P={P} {link}: {len(configs)} configurations", flush=True)
                try:
                    ranks = launch(P, link, rate, args, configs)
                except RuntimeError as exc:
                    print(str(exc), file=sys.stderr, flush=True)
                    errors.append(str(exc)[:2000])
                    continue
                done = summarise(P, link, rate, ranks)
                if args.share_cores is not None:
                    dilate(done, cpushare.fraction(P, args.share_cores))
                records += done
                print(f"P={P} {link}: done in {time.time() - t0:.0f} s", flush=True)
                partial = {"runs": [], "records": records}
                out_json.with_suffix(".partial.json").write_text(json.dumps(partial))
        run = {
            "argv": sys.argv[1:],
            "workers": args.workers,
            "links": [link for link, _ in links],
            "namespaces": ok,
            "fallback_reason": None if ok else why,
            "px": args.px,
            "batch": args.batch,
            "iters": args.iters,
            "warmup": args.warmup,
            "errors": errors,
            "cpus": os.cpu_count(),
            "pin_from": args.pin_from,
            "share_cores": args.share_cores,
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
            "wall_s": round(time.time() - started, 1),
            "machine": platform.platform(),
            "torch": __import__("torch").__version__,
        }
        result = {"runs": [run], "records": records}
        out_json.with_suffix(".partial.json").unlink(missing_ok=True)
        if args.merge and out_json.exists():  # same (link, P, hook, density) replaced
            old = json.loads(out_json.read_text())

            def key(r):
                return (r["link"], r["P"], r["hook"], r["density"])

            new_keys = {key(r) for r in records}
            kept = [r for r in old["records"] if key(r) not in new_keys]
            result = {"runs": old["runs"] + [run], "records": kept + records}
    result["goals"] = goals(result["records"])
    out_json.write_text(json.dumps(result, indent=1))
    (args.out / "comm_iteration.md").write_text(markdown(result))
    print(f"wrote {out_json} and comm_iteration.md", flush=True)
    return 0
