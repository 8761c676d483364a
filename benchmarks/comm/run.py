"""Time and bytes per iteration of every gradient-communication hook on shaped links.

For each link rate and worker count P, one launch of P processes (each in its own network
namespace joined by a bridge, egress shaped with ``tc`` to the rate; see ``netns.py``) runs
every hook x density in sequence on the gradient of a real model (``worker.py``). Hooks:
``dense`` (all-reduce, the baseline), torch's ``powersgd`` (rank 4, a different compression:
low-rank, not sparse), ``topk``, ``gaussiank``, ``spardl`` (one team), ``spardl-t2`` (two
teams, even P only), ``exdyna``, ``dfs``. Without namespaces (not root, no iproute2) the
workers share loopback, unshaped, and the report says so.

    python benchmarks/comm/run.py                                   # full grid
    python benchmarks/comm/run.py --workers 2,4 --densities 0.01 --links 1000 \
        --params 1000000 --iters 3 --out /tmp/comm                  # quick check

``--merge`` adds this invocation's records to an existing ``comm.json`` (same key replaced),
so a grid can be filled in several runs. Writes ``comm.json``, ``comm.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext, suppress
from pathlib import Path
from statistics import mean, median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.comm import cpushare, netns, report  # noqa: E402

HOOKS = report.ORDER  # the hooks benchmarked are the ones the report lays out, in its order
# --mode iteration: torch's no-op hook is the baseline; "-async" = our FIFO comm thread;
# "-plain" = the reference CPU paths before issue 19's grouped scan, "-grouped" = its torch
# paths without the compiled pass (iteration.py)
ITERATION_HOOKS = (
    "noop",
    *HOOKS,
    "spardl-async",
    "topk-async",
    "spardl-plain",
    "topk-plain",
    "spardl-grouped",
    "topk-grouped",
)
DENSE_HOOKS = ("noop", "dense", "powersgd")  # density does not apply: run once per (P, link)
WORKER = Path(__file__).resolve().parent / "worker.py"
ITERATION_WORKER = Path(__file__).resolve().parent / "iteration.py"
PORT = 29531


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=_ints, default=_ints("2,3,4,5,6,8"))
    ap.add_argument("--densities", type=_floats, default=_floats("0.1,0.01,0.001"))
    ap.add_argument("--links", type=_ints, default=_ints("1000,10000"), help="Mbit/s")
    ap.add_argument("--hooks", default=",".join(HOOKS), help="subset of " + ",".join(HOOKS))
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per hook x density")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    ap.add_argument("--grads", type=int, default=3, help="distinct real gradients, cycled")
    ap.add_argument("--params", default="resnet18", help="timm model name or element count")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--powersgd-start", type=int, default=2, help="start_powerSGD_iter")
    ap.add_argument("--loopback", action="store_true", help="skip namespaces, use 127.0.0.1")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per launch")
    ap.add_argument("--merge", action="store_true", help="add to an existing comm.json")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--report-only", action="store_true", help="re-render comm.md and plots from comm.json"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument(
        "--mode",
        choices=("hooks", "iteration"),
        default="hooks",
        help="hooks: hook calls on precomputed gradients (worker.py); iteration: whole DDP "
        "iterations on a realistic gradient, minus torch's no-op hook (iteration.py)",
    )
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link")
    ap.add_argument("--px", type=int, default=96, help="--mode iteration: image size")
    ap.add_argument("--batch", type=int, default=2, help="--mode iteration: images per rank")
    ap.add_argument(
        "--pin-from",
        type=int,
        default=None,
        help="pin worker r to CPU core PIN_FROM + r (one core per worker; needs enough cores)",
    )
    ap.add_argument(
        "--share-cores",
        type=int,
        default=None,
        help="--mode iteration: emulate one core per worker on this many cores by time "
        "dilation (each worker a 1/ceil(P/N) CFS quota of a core, links at that fraction of "
        "their rate, wall times scaled back; see cpushare.py)",
    )
    args = ap.parse_args(argv)
    hooks = [h for h in args.hooks.split(",") if h]
    if args.mode == "iteration" and "noop" not in hooks:
        hooks = ["noop", *hooks]
    bad = sorted(set(hooks) - set(ITERATION_HOOKS if args.mode == "iteration" else HOOKS))
    if bad:
        ap.error(f"unknown hooks {bad}; choose from {', '.join(HOOKS)}")
    args.hooks = hooks
    if min(args.workers) < 2:
        ap.error("--workers: every P must be >= 2")
    if args.share_cores is not None:
        if args.mode != "iteration" or args.pin_from is not None or args.share_cores < 1:
            ap.error("--share-cores N (N >= 1) needs --mode iteration and no --pin-from")
        if args.share_cores > len(os.sched_getaffinity(0)):
            ap.error(f"--share-cores {args.share_cores}: only {len(os.sched_getaffinity(0))} cores")
        ok, why = cpushare.available()
        if not ok:
            ap.error(f"--share-cores: {why}")
    if args.pin_from is not None:
        cores = os.sched_getaffinity(0)
        want = set(range(args.pin_from, args.pin_from + max(args.workers)))
        if not want <= cores:
            ap.error(f"--pin-from {args.pin_from}: cores {sorted(want - cores)} not available")
    return args


def configs_for(P: int, hooks: list[str], densities: list[float]) -> list[tuple[str, Any]]:
    """(hook label, density or None) in the order one launch runs them."""
    out: list[tuple[str, Any]] = [(h, None) for h in hooks if h in DENSE_HOOKS]
    for d in densities:
        for h in hooks:
            if h in DENSE_HOOKS or (h.startswith("spardl-t") and P % int(h[8:])):
                continue
            out.append((h, d))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(first: int | None, rank: int):
    """A ``preexec_fn`` that binds the worker to core ``first + rank`` (inherited through
    ``ip netns exec``), or None to leave scheduling to the kernel."""
    if first is None:
        return None
    return lambda: os.sched_setaffinity(0, {first + rank})


def _stop(procs: list[subprocess.Popen]) -> None:
    """End the worker processes this launch started (each in its own session), by id."""
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def launch(P: int, link: str, rate: int | None, args, configs) -> list[dict[str, Any]]:
    """Run one (P, link) launch; returns the per-rank result dicts."""
    with tempfile.TemporaryDirectory(prefix="zp_comm_") as tmp:
        spec = {
            "world": P,
            "link": link,
            "params": str(args.params),
            "grads": args.grads,
            "iters": args.iters,
            "warmup": args.warmup,
            "powersgd_rank": args.powersgd_rank,
            "powersgd_start": args.powersgd_start,
            "timeout": args.timeout,
            "configs": configs,
            "out_dir": tmp,
            "px": args.px,
            "batch": args.batch,
        }
        worker = ITERATION_WORKER if args.mode == "iteration" else WORKER
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        shares = None
        if args.share_cores is not None:
            cores = sorted(os.sched_getaffinity(0))[: args.share_cores]
            shares = cpushare.Shares(P, cores, cpushare.fraction(P, args.share_cores))
            rate = None if rate is None else rate * shares.share
        ctx = (
            netns.cluster(P, rate_mbit=rate, delay_ms=args.delay_ms)
            if rate is not None
            else nullcontext(None)
        )
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            with ctx as cl, shares or nullcontext():
                port = PORT if cl is not None else _free_port()
                for rank in range(P):
                    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
                    env["PYTHONUNBUFFERED"] = "1"
                    env["MASTER_PORT"] = str(port)
                    if cl is not None:
                        env["MASTER_ADDR"] = cl.addresses[0]
                        env["GLOO_SOCKET_IFNAME"] = cl.interfaces[rank]
                        prefix = cl.prefix(rank)
                    else:
                        env["MASTER_ADDR"] = "127.0.0.1"
                        env["GLOO_SOCKET_IFNAME"] = "lo"
                        prefix = []
                    log = open(Path(tmp, f"rank{rank}.log"), "w")  # noqa: SIM115
                    logs.append(log)
                    cmd = [*prefix, sys.executable, str(worker), str(spec_path), str(rank)]
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            env=env,
                            stdout=log,
                            stderr=None if rank == 0 else log,
                            start_new_session=True,
                            preexec_fn=(
                                shares.confine(rank) if shares else _pin(args.pin_from, rank)
                            ),
                        )
                    )
                deadline = time.monotonic() + args.timeout
                while any(p.poll() is None for p in procs):
                    if any(p.poll() not in (None, 0) for p in procs):
                        break
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                failed = [r for r, p in enumerate(procs) if p.poll() != 0]
                if failed:
                    _stop(procs)
                    tail = Path(tmp, f"rank{failed[0]}.log").read_text()[-3000:]
                    partial = _partial(tmp, P) if args.mode == "iteration" else None
                    if partial:  # the configurations finished before the failure
                        print(f"P={P} {link}: rank(s) {failed} failed:\n{tail}", flush=True)
                        return partial
                    raise RuntimeError(
                        f"P={P} {link}: rank(s) {failed} failed or timed out:\n{tail}"
                    )
        finally:
            _stop(procs)
            for log in logs:
                log.close()
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(P)]


def _partial(tmp: str, P: int) -> list[dict[str, Any]] | None:
    """Per-rank results of the configurations every rank finished (iteration mode writes
    them after each configuration), or None."""
    paths = [Path(tmp, f"rank{r}.json") for r in range(P)]
    if not all(p.exists() for p in paths):
        return None
    ranks = [json.loads(p.read_text()) for p in paths]
    done = min(len(r["configs"]) for r in ranks)
    for r in ranks:
        r["configs"] = r["configs"][:done]
    return ranks if done else None


def summarise(P: int, link: str, rate: int | None, ranks: list[dict]) -> list[dict[str, Any]]:
    """One record per (hook, density): medians over timed iterations. Time per iteration is
    the slowest rank's (the step ends when the last worker has its gradient); select / comm
    seconds and bytes are the mean over ranks; ``bytes_sent_max`` the busiest rank's."""
    bucket_numel = ranks[0]["bucket_numel"]
    out = []
    for c, cfg in enumerate(ranks[0]["configs"]):
        per_rank = [r["configs"][c]["iters"] for r in ranks]
        n_it = len(per_rank[0])

        def over_iters(key: str, agg, per_rank=per_rank, n_it=n_it) -> float | None:
            if key not in per_rank[0][0]:
                return None
            return median(agg([pr[i][key] for pr in per_rank]) for i in range(n_it))

        rec = {
            "link": link,
            "link_mbit": rate,
            "P": P,
            "hook": cfg["hook"],
            "density": cfg["density"],
            "numel": sum(bucket_numel),
            "buckets": len(bucket_numel),
            "bucket_numel": bucket_numel,
            "bucket_zero_fraction": ranks[0].get("bucket_zero_fraction"),
            "iters": n_it,
            "time_s": over_iters("wall_s", max),
            "time_s_iters": [max(pr[i]["wall_s"] for pr in per_rank) for i in range(n_it)],
            "cpu_s": over_iters("cpu_s", mean),
            "select_s": over_iters("select_s", mean),
            "comm_s": over_iters("comm_s", mean),
            "bytes_sent": over_iters("bytes_sent", mean),
            "bytes_sent_max": over_iters("bytes_sent", max),
            "bytes_recv": over_iters("bytes_recv", mean),
            "nnz": over_iters("nnz", mean),
        }
        out.append(rec)
    return out


def _key(rec: dict[str, Any]) -> tuple:
    return (rec["link"], rec["P"], rec["hook"], rec["density"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "iteration":
        from benchmarks.comm import iteration_report

        return iteration_report.main(args, launch, configs_for)
    if args.report_only:
        return write_report(json.loads((args.out / "comm.json").read_text()), args)
    started = time.time()
    ok, why = (False, "--loopback given") if args.loopback else netns.available()
    if ok:
        lag = f"-{args.delay_ms:g}ms" if args.delay_ms else ""
        links: list[tuple[str, int | None]] = [(f"{r}mbit{lag}", r) for r in args.links]
    else:
        print(f"network namespaces unavailable ({why}): plain loopback, unshaped", flush=True)
        links = [("loopback", None)]
    load_before = os.getloadavg()
    records: list[dict[str, Any]] = []
    launches = []
    errors = []
    for link, rate in links:
        for P in args.workers:
            configs = configs_for(P, args.hooks, args.densities)
            t0 = time.time()
            print(f"P={P} {link}: {len(configs)} hook x density configurations", flush=True)
            try:
                ranks = launch(P, link, rate, args, configs)
            except RuntimeError as exc:
                print(str(exc), file=sys.stderr, flush=True)
                errors.append(str(exc)[:2000])
                continue
            records += summarise(P, link, rate, ranks)
            launches.append({"P": P, "link": link, "seconds": round(time.time() - t0, 1)})
            print(f"P={P} {link}: done in {time.time() - t0:.0f} s", flush=True)
    run_info = {
        "argv": sys.argv[1:] if argv is None else argv,
        "workers": args.workers,
        "densities": args.densities,
        "links": [link for link, _ in links],
        "hooks": args.hooks,
        "params": str(args.params),
        "iters": args.iters,
        "warmup": args.warmup,
        "grads": args.grads,
        "powersgd": {"rank": args.powersgd_rank, "start_powerSGD_iter": args.powersgd_start},
        "namespaces": ok,
        "fallback_reason": None if ok else why,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "launches": launches,
        "errors": errors,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "machine": platform.platform(),
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
    }
    path = args.out / "comm.json"
    runs = [run_info]
    if args.merge and path.exists():
        old = json.loads(path.read_text())
        new_keys = {_key(r) for r in records}
        records = [r for r in old["records"] if _key(r) not in new_keys] + records
        runs = old["runs"] + runs
    records.sort(key=lambda r: (r["link"], r["P"], HOOKS.index(r["hook"]), r["density"] or 0))
    write_report({"runs": runs, "records": records}, args)
    print(f"({time.time() - started:.0f} s)", flush=True)
    return 1 if errors else 0


def write_report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """(Re)compute the goals; write comm.json, comm.md and the plots under ``args.out``."""
    result["goals"] = report.goals(result["records"])
    (args.out / "comm.json").write_text(json.dumps(result, indent=1))
    (args.out / "comm.md").write_text(report.markdown(result))
    if not args.no_plots:
        report.plots(result["records"], args.out)
    print(f"wrote {args.out / 'comm.json'}, comm.md and plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
