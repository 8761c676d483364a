"""Goal verdicts, the markdown report and the plots of the communication benchmark."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from zoopick.training.comm.select import k_for

PAIR_BYTES = 8  # int32 index + float32 value
BYTES_GOAL = 1.1
DENSE_SPEEDUP_GOAL = 5.0
GOAL_LINK = "1000mbit"
GOAL_DENSITY = 0.01
ORDER = (
    "dense",
    "powersgd",
    "topk",
    "gaussiank",
    "spardl",
    "spardl-t2",
    "spardl-t4",
    "exdyna",
    "dfs",
)


def link_name(link: str) -> str:
    if link.endswith("mbit"):
        mbit = int(link[:-4])
        return f"{mbit // 1000} Gbit/s" if mbit % 1000 == 0 else f"{mbit} Mbit/s"
    return link


def link_file(link: str) -> str:
    if link.endswith("mbit") and int(link[:-4]) % 1000 == 0:
        return f"{int(link[:-4]) // 1000}gbit"
    return link


def spardl_ideal_bytes(rec: dict[str, Any]) -> float:
    """2 k (P - 1) / P (index, value) pairs, k summed over the buckets."""
    k = sum(k_for(rec["density"], n) for n in rec["bucket_numel"])
    P = rec["P"]
    return 2 * k * (P - 1) / P * PAIR_BYTES


def one_core_estimate(rec: dict[str, Any]) -> float | None:
    """What an iteration would take if each worker had its own core: the worker's CPU seconds
    (selection, bookkeeping, gloo's own work) plus the bytes it sends at the link rate. A rough
    model (no latency, no overlap), shown next to the measurement, never instead of it."""
    if rec.get("cpu_s") is None or not rec.get("link_mbit") or rec.get("bytes_sent") is None:
        return None
    return rec["cpu_s"] + rec["bytes_sent"] * 8 / (rec["link_mbit"] * 1e6)


def _find(records, link, P, hook, density):
    for r in records:
        if (r["link"], r["P"], r["hook"]) == (link, P, hook) and (
            hook in ("dense", "powersgd") or r["density"] == density
        ):
            return r
    return None


def goals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    # 1. SparDL bytes
    rows = []
    for r in records:
        if r["hook"] == "spardl" and r["bytes_sent_max"] is not None:
            ideal = spardl_ideal_bytes(r)
            rows.append(
                {
                    "link": r["link"],
                    "P": r["P"],
                    "density": r["density"],
                    "bytes_sent_max": r["bytes_sent_max"],
                    "ideal": ideal,
                    "ratio": r["bytes_sent_max"] / ideal,
                }
            )
    worst = max((row["ratio"] for row in rows), default=None)
    out.append(
        {
            "goal": f"spardl bytes sent per worker within {BYTES_GOAL}x of 2k(P-1)/P pairs",
            "met": None if worst is None else worst <= BYTES_GOAL,
            "detail": "not measured"
            if worst is None
            else f"worst ratio {worst:.3f} over {len(rows)} (P, density, link) runs",
            "rows": rows,
        }
    )
    # 2. P = 4, 1 Gbit/s, 1 %: spardl >= 5x faster than dense
    dense = _find(records, GOAL_LINK, 4, "dense", None)
    spardl = _find(records, GOAL_LINK, 4, "spardl", GOAL_DENSITY)
    if dense and spardl:
        speedup = dense["time_s"] / spardl["time_s"]
        g = {
            "met": speedup >= DENSE_SPEEDUP_GOAL,
            "detail": f"dense {dense['time_s'] * 1e3:.0f} ms / spardl "
            f"{spardl['time_s'] * 1e3:.0f} ms = {speedup:.2f}x",
            "speedup": speedup,
        }
        est = one_core_estimate(spardl)
        if est is not None:
            g["one_core_estimate_s"] = est
            g["detail"] += (
                f" (with a core per worker, estimated from its CPU seconds "
                f"{spardl['cpu_s']:.3f} s + wire time at the link rate: {est * 1e3:.0f} ms, "
                f"{dense['time_s'] / est:.1f}x; an estimate, not a measurement)"
            )
    else:
        g = {"met": None, "detail": "not measured"}
    g["goal"] = f"1 Gbit/s, P=4, density 1%: spardl >= {DENSE_SPEEDUP_GOAL:g}x faster than dense"
    out.append(g)
    # 3. spardl faster than topk for every P >= 4 (1 Gbit/s, 1 %)
    rows = []
    for P in sorted({r["P"] for r in records if r["link"] == GOAL_LINK and r["P"] >= 4}):
        s = _find(records, GOAL_LINK, P, "spardl", GOAL_DENSITY)
        t = _find(records, GOAL_LINK, P, "topk", GOAL_DENSITY)
        if s and t:
            rows.append({"P": P, "spardl_s": s["time_s"], "topk_s": t["time_s"]})
    out.append(
        {
            "goal": "1 Gbit/s, density 1%: spardl faster than topk for every P >= 4",
            "met": None if not rows else all(r["spardl_s"] < r["topk_s"] for r in rows),
            "detail": "not measured"
            if not rows
            else ", ".join(
                f"P={r['P']}: {r['topk_s'] / r['spardl_s']:.2f}x"
                + ("" if r["spardl_s"] < r["topk_s"] else " (slower)")
                for r in rows
            )
            + " (topk time / spardl time)",
            "rows": rows,
        }
    )
    return out


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("**met**" if met else "**not met**")


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def _mb(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e6:.2f}" if x < 1e8 else f"{x / 1e6:.0f}"


def _hooks(records) -> list[str]:
    present = {r["hook"] for r in records}
    return [h for h in ORDER if h in present]


def _hook_table(
    title: str, hooks: list[str], Ps: list[int], cell: Callable[[str, int], str]
) -> list[str]:
    """A markdown table under ``title``: a row per hook, a column per world size P."""
    lines = [
        title,
        "",
        "| hook | " + " | ".join(f"P={P}" for P in Ps) + " |",
        "|---|" + "---|" * len(Ps),
    ]
    lines += [f"| {h} | " + " | ".join(cell(h, P) for P in Ps) + " |" for h in hooks]
    return lines


def _iteration_cell(recs, link: str, d: float, h: str, P: int) -> str:
    """Time per iteration (ms), with the speed-up over dense in brackets."""
    r = _find(recs, link, P, h, d)
    base = _find(recs, link, P, "dense", None)
    if r is None:
        return "—"
    if base is None or h == "dense":
        return _ms(r["time_s"])
    return f"{_ms(r['time_s'])} ({base['time_s'] / r['time_s']:.1f}x)"


def _split_cell(recs, link: str, d: float, h: str, P: int) -> str:
    """select / comm / other (ms), a worker's CPU seconds in brackets."""
    r = _find(recs, link, P, h, d)
    if r is None:
        return "—"
    if r["select_s"] is None:
        return f"total {_ms(r['time_s'])} ({r['cpu_s']:.2f})"
    other = max(r["time_s"] - r["select_s"] - r["comm_s"], 0.0)
    return f"{_ms(r['select_s'])} / {_ms(r['comm_s'])} / {_ms(other)} ({r['cpu_s']:.2f})"


def _sent_cell(recs, link: str, d: float, h: str, P: int) -> str:
    """Bytes sent per worker per iteration (MB)."""
    r = _find(recs, link, P, h, d)
    return "—" if r is None else _mb(r["bytes_sent"])


def markdown(result: dict[str, Any]) -> str:
    records = result["records"]
    lines = ["# Communication benchmark", ""]
    lines += [
        "Time and bytes per training iteration of each gradient-communication hook, one process",
        "per worker (each in its own network namespace, links shaped with `tc`), on the",
        "gradient of a real model cut into DDP-style buckets (see `benchmarks/comm/README.md`).",
        "Time is the median over timed iterations of the slowest worker's wall time for all",
        "hook calls of an iteration; *select* and *comm* are the hooks' own `state.stats`",
        "seconds (mean over workers), *other* is the rest (residual bookkeeping, adding the",
        "received pairs, ...). `powersgd` is torch's PowerSGD hook (rank "
        + str(result["runs"][-1]["powersgd"]["rank"])
        + ", low-rank, not sparse: its density column does not apply; bytes counted at its",
        "all-reduces, time not split). Bytes are what one worker sends per iteration.",
        "",
        f"Each worker runs one torch thread; this machine has {result['runs'][-1]['cpus']} "
        "CPUs, shared with other jobs (load averages below). For P above the core count the",
        "selection step is CPU-bound, and a worker's *comm* time includes waiting in a",
        "collective for peers that are still selecting: compare the CPU seconds per worker",
        "with the wall time before reading the totals as network cost.",
        "",
        "## Runs",
        "",
    ]
    for run in result["runs"]:
        where = (
            "network namespaces, shaped links"
            if run["namespaces"]
            else f"plain loopback, unshaped ({run['fallback_reason']})"
        )
        lines.append(
            f"- {run['started']}: `{' '.join(run['argv']) or '(defaults)'}` — P {run['workers']}, "
            f"densities {run['densities']}, links {run['links']}, params {run['params']}, "
            f"{run['warmup']} warm-up + {run['iters']} timed iterations; {where}; "
            f"{run['wall_s'] / 60:.1f} min wall on {run['cpus']} CPUs (load average "
            f"{run['loadavg_before'][0]} before, {run['loadavg_after'][0]} after)"
            + (f"; {len(run['errors'])} launch(es) failed" if run["errors"] else "")
        )
    lines += ["", "## Goals", "", "| goal | verdict | detail |", "|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {_verdict(g['met'])} | {g['detail']} |")
    lines.append("")
    for link in sorted({r["link"] for r in records}, key=_link_order):
        recs = [r for r in records if r["link"] == link]
        Ps = sorted({r["P"] for r in recs})
        hooks = _hooks(recs)
        densities = sorted({r["density"] for r in recs if r["density"] is not None}, reverse=True)
        lines += [f"## {link_name(link)}", ""]
        rates = [
            r["bytes_sent"] * 8 / r["time_s"] / 1e9
            for r in recs
            if r["hook"] == "dense" and r["bytes_sent"] and r["time_s"]
        ]
        if rates:
            lines += [
                f"Link check: `dense` puts {min(rates):.2f}-{max(rates):.2f} Gbit/s per worker "
                f"on the wire (bytes sent / time) on this {link_name(link)} link.",
                "",
            ]
        for d in densities:
            lines += _hook_table(
                f"### Time per iteration, density {d:g} (ms; in brackets: speed-up over dense)",
                hooks,
                Ps,
                partial(_iteration_cell, recs, link, d),
            )
            lines.append("")
        d = GOAL_DENSITY if GOAL_DENSITY in densities else (densities[0] if densities else None)
        lines += _hook_table(
            f"### Where the time goes, density {d:g}: select / comm / other (ms), "
            "CPU seconds of a worker in brackets",
            hooks,
            Ps,
            partial(_split_cell, recs, link, d),
        )
        lines.append("")
        for d in densities:
            lines += _hook_table(
                f"### Bytes sent per worker per iteration, density {d:g} (MB)",
                hooks,
                Ps,
                partial(_sent_cell, recs, link, d),
            )
            ideal = []
            for P in Ps:
                r = _find(recs, link, P, "spardl", d)
                ideal.append("—" if r is None else _mb(spardl_ideal_bytes(r)))
            lines.append("| *2k(P-1)/P pairs* | " + " | ".join(ideal) + " |")
            lines.append("")
    lines += achieved_density_table(records)
    return "\n".join(lines) + "\n"


GATHERED = ("topk", "gaussiank", "dfs")  # stats nnz counts every worker's pairs


def achieved_density_table(records: list[dict[str, Any]]) -> list[str]:
    """Selected elements per worker over k = density * numel, at P = 4 (or the nearest P) on
    the first link: exact top-k gives 1.0; threshold schemes drift from it."""
    recs = [r for r in records if r["density"] is not None and r["nnz"] is not None]
    if not recs:
        return []
    link = sorted({r["link"] for r in recs}, key=_link_order)[0]
    recs = [r for r in recs if r["link"] == link]
    P = min({r["P"] for r in recs}, key=lambda p: abs(p - 4))
    recs = [r for r in recs if r["P"] == P]
    densities = sorted({r["density"] for r in recs}, reverse=True)
    lines = [
        f"## Achieved density (P={P}, {link_name(link)})",
        "",
        "Elements selected per iteration over k = density x gradient size: per worker for the",
        "all-gather schemes (topk, gaussiank, dfs: block values), in the applied sum for",
        "spardl and exdyna. 1.00 = exactly the asked density.",
        "",
        "| hook | " + " | ".join(f"{d:g}" for d in densities) + " |",
        "|---|" + "---|" * len(densities),
    ]
    for h in _hooks(recs):
        cells = []
        for d in densities:
            r = _find(recs, link, P, h, d)
            if r is None:
                cells.append("—")
                continue
            per = r["nnz"] / P if h in GATHERED else r["nnz"]
            cells.append(f"{per / (d * r['numel']):.2f}")
        lines.append(f"| {h} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _link_order(link: str) -> tuple[int, str]:
    return (int(link[:-4]), link) if link.endswith("mbit") else (math.inf, link)


def plots(records: list[dict[str, Any]], out: Path) -> list[Path]:
    """comm_time_<link>.png (time/iter vs P at 1 %), comm_bytes.png, comm_split.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    links = sorted({r["link"] for r in records}, key=_link_order)
    d = GOAL_DENSITY
    for link in links:
        recs = [r for r in records if r["link"] == link]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for h in _hooks(recs):
            pts = sorted(
                (r["P"], r["time_s"])
                for r in recs
                if r["hook"] == h and (r["density"] in (None, d))
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=h)
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_ylabel("seconds per iteration (median, slowest worker)")
        ax.set_title(f"{link_name(link)}, density {d:g}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        path = out / f"comm_time_{link_file(link)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    densities = sorted({r["density"] for r in records if r["density"] is not None}, reverse=True)
    link = links[0] if links else None
    if link is not None and densities:
        fig, axes = plt.subplots(1, len(densities), figsize=(5 * len(densities), 4.2), sharey=True)
        axes = [axes] if len(densities) == 1 else list(axes)
        recs = [r for r in records if r["link"] == link]
        for ax, dd in zip(axes, densities, strict=True):
            for h in _hooks(recs):
                pts = sorted(
                    (r["P"], r["bytes_sent"])
                    for r in recs
                    if r["hook"] == h and r["density"] in (None, dd) and r["bytes_sent"]
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=h)
            ideal = sorted(
                (r["P"], spardl_ideal_bytes(r))
                for r in recs
                if r["hook"] == "spardl" and r["density"] == dd
            )
            if ideal:
                ax.plot(*zip(*ideal, strict=True), "k--", lw=1, label="2k(P-1)/P pairs")
            ax.set_yscale("log")
            ax.set_xlabel("workers P")
            ax.set_title(f"density {dd:g}")
            ax.grid(alpha=0.3, which="both")
        axes[0].set_ylabel(f"bytes sent per worker per iteration ({link_name(link)})")
        axes[-1].legend(fontsize=7)
        path = out / "comm_bytes.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # where the time goes at P = 4 (or the closest P measured), density 1 %
    split = [r for r in records if r["density"] in (None, d)]
    if split:
        Ps = sorted({r["P"] for r in split}, key=lambda p: abs(p - 4))
        P = Ps[0]
        fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
        for ax, link in zip(axes[0], links, strict=True):
            recs = [r for r in split if r["link"] == link and r["P"] == P]
            hooks = _hooks(recs)
            sel, com, oth, whole = [], [], [], []
            for h in hooks:
                r = next(x for x in recs if x["hook"] == h)
                split_known = r["select_s"] is not None and r["comm_s"] is not None
                s = r["select_s"] if split_known else 0.0
                c = r["comm_s"] if split_known else 0.0
                sel.append(s)
                com.append(c)
                oth.append(max(r["time_s"] - s - c, 0.0) if split_known else 0.0)
                whole.append(0.0 if split_known else r["time_s"])
            x = range(len(hooks))
            ax.bar(x, sel, label="select")
            ax.bar(x, com, bottom=sel, label="communicate")
            ax.bar(x, oth, bottom=[a + b for a, b in zip(sel, com, strict=True)], label="other")
            if any(whole):
                ax.bar(x, whole, color="grey", label="total (not split)")
            ax.set_xticks(list(x), hooks, rotation=30, fontsize=8)
            ax.set_ylabel("seconds per iteration")
            ax.set_title(f"P={P}, density {d:g}, {link_name(link)}")
            ax.legend(fontsize=8)
        path = out / "comm_split.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
