"""The suite's fine-tuning run logs, carried from one session's machine to the next."""

from __future__ import annotations

import json
from pathlib import Path

RUN_LOGS = ("gt_runs.jsonl", "service_runs.jsonl")


def merge_run_logs(src: Path, dst: Path) -> int:
    """Append to ``dst``'s run logs (``RUN_LOGS``) the runs of ``src``'s whose key ``dst`` lacks;
    returns how many. Zoo folders are git-ignored and a session's machine starts bare, so the
    fine-tuning runs are kept beside the results (``<out>/transfer_suite_runs/<zoo>/``) and
    merged back before the next session's suite runs: runs are keyed by checkpoint and data
    hashes, so a rebuild that gives the same bytes resumes where the last one stopped, and one
    that does not simply reruns."""
    added = 0
    for name in RUN_LOGS:
        if not (src / name).exists():
            continue
        have: set[str] = set()
        if (dst / name).exists():
            lines = (dst / name).read_text().splitlines()
            have = {json.loads(x)["key"] for x in lines if x.strip()}
        new = [
            x
            for x in (src / name).read_text().splitlines()
            if x.strip() and json.loads(x)["key"] not in have
        ]
        if new:
            dst.mkdir(parents=True, exist_ok=True)
            with (dst / name).open("a") as f:
                f.write("\n".join(new) + "\n")
            added += len(new)
    return added
