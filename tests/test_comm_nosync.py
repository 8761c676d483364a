"""No host syncs in the hooks' steady state (issue 9).

The guard (``tests/host_sync_guard.py``) records every op that would make the host wait for
an accelerator: value reads (``item``/``int``/``float``/``bool``/``tolist``), ops whose
output size depends on the data (``nonzero``, ``unique``, ...) and boolean-mask indexing.
First it is shown to catch each of them and to let sanctioned (deferred) reads pass; then
every hook runs on P = 4 gloo processes, a few iterations unguarded (a bucket's first
iteration seeds thresholds) and then guarded, with the CPU-only selection shortcuts
switched off so the path that runs on an accelerator is the one checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import zoopick.training.comm as comm
from tests.comm_harness import launch_cached
from tests.host_sync_guard import no_host_reads
from zoopick.training.comm import hostread

CONFIGS = {
    "dense": ("dense", {}),
    "topk": ("topk", {}),
    "gaussiank": ("gaussiank", {}),
    "spardl": ("spardl", {"momentum": 0.9}),
    "spardl_teams2_fp16": ("spardl", {"teams": 2, "fp16": True}),
    "spardl_p16bf": ("spardl", {"pairs16": "bf16"}),
    "exdyna": ("exdyna", {"blocks": 16}),
    "exdyna_paper": ("exdyna", {"blocks": 16, "controller": "paper"}),
    "dfs": ("dfs", {}),
}
SHAPES = [(40, 25), (300,), (63,), (500,)]
WARM, GUARDED = 3, 3


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: int(x.sum()),
        lambda x: float(x.max()),
        lambda x: bool(x.sum() > 0),
        lambda x: x.tolist(),
        lambda x: torch.nonzero(x > 0),
        lambda x: x[x > 0],
        lambda x: x.__setitem__(x > 0, 0.0),
        lambda x: torch.unique(x),
        lambda x: torch.bincount((x > 0).long()),
        lambda x: torch.tensor([1.0, 2.0], device=x.device),
        lambda x: x.new_tensor([1.0]),
        lambda x: x.__setitem__(torch.arange(2), 0.0),  # scalar copied to the device
        lambda x: x.__setitem__((torch.arange(2),), True),
    ],
)
def test_guard_catches_host_reads(read):
    x = torch.randn(16)
    with no_host_reads() as found:
        read(x)
    assert found


def test_guard_passes_device_ops_and_sanctioned_reads():
    x = torch.randn(16)
    with no_host_reads() as found:
        idx = torch.topk(x.abs(), 4).indices
        x.index_add_(0, idx, -x[idx])
        x.masked_fill_(x > 1, 0.0)
        x.index_fill_(0, idx, 0.0)  # the scalar is a kernel argument, no copy
        x[2:5] = 0.0  # a slice: fill_ of a view
        x[idx] = x[idx] * 2  # a tensor value: already on the device
        torch.full((), 3.0) * x
        with hostread.sanctioned():
            x.sum().item()
        hostread.Deferred(x.sum()).get()
    assert found == []


def _steady(rank: int, P: int, name: str, options: dict) -> list[str]:
    from zoopick.training.comm import select

    select.CPU_SHORTCUTS = False
    gen = torch.Generator().manual_seed(rank)
    params = [torch.zeros(s) for s in SHAPES]
    state, hook = comm.make_hook(name, density=0.05, **options)
    found: list[str] = []
    for it in range(WARM + GUARDED):
        split = [[0, 1], [2, 3]] if it == 0 else [[3, 0], [1, 2]]  # DDP's rebuild
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        buckets = [
            comm.SimpleBucket(
                [params[i] for i in m], [grads[i] for i in m], index=b, is_last=b == 1
            )
            for b, m in enumerate(split)
        ]
        if it < WARM:
            for bucket in buckets:
                hook(state, bucket).wait()
            continue
        with no_host_reads() as seen:
            for bucket in buckets:
                hook(state, bucket).wait()
        found += seen
    return found


def _all(rank: int, P: int) -> dict[str, list[str]]:
    return {key: _steady(rank, P, name, opts) for key, (name, opts) in CONFIGS.items()}


@pytest.fixture(scope="module")
def run():
    return launch_cached(_all, 4)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_steady_state_has_no_host_reads(run, key):
    for rank, res in enumerate(run):
        assert res[key] == [], f"rank {rank}: {sorted(set(res[key]))[:6]}"


def test_hooks_have_no_device_to_host_copies():
    """The one read the guard cannot see on a CPU: ``.cpu()`` / ``.to("cpu")`` (a no-op
    here, a copy on an accelerator). Only the checkpoint's ``store.named`` has one."""
    src = Path(comm.__file__).parent
    hits = [
        f"{path.name}: {line.strip()}"
        for path in sorted(src.glob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"\.cpu\(\)|\.to\(\s*[\"']cpu", line)
    ]
    assert len(hits) == 1 and hits[0].startswith("store.py: return {names[key]: t.detach().cpu()")
