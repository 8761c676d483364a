"""The hostile-input corpus (tests/hostile.py) at small sizes, and a fuzz pass over the dataset
readers: every input ends in a ``DatasetError`` with a plain message (no exception class, no
object repr), within bounded memory and CPU, never in another exception. ``benchmarks/hostile``
runs the same corpus at full size against a running service."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import random
import re
import resource
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tests.bombs import MiB
from tests.hostile import PAD, Hostile, corpus, tar_of, zip_of
from zoopick.selection.data import DatasetError, TargetDataset, load_dataset
from zoopick.selection.limits import DatasetLimits

# the service's limits scaled to the corpus' small sizes
LIMITS = DatasetLimits(
    max_member_bytes=8 * MiB,
    max_total_bytes=32 * MiB,
    max_compression_ratio=100,
    max_members=2000,
    max_pixels=4096 * 4096,
    max_classes=500,
    min_per_class=2,
    max_cpu_seconds=5,
)
CORPUS = corpus()
NOT_PLAIN = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>|\w+Error\(|Traceback|ZipInfo")


def plain(message: str) -> bool:
    """Says what is wrong without an object repr, an exception's repr or a traceback."""
    return bool(message.strip()) and not NOT_PLAIN.search(message)


@pytest.mark.parametrize("item", CORPUS, ids=[h.name for h in CORPUS])
def test_every_hostile_input_is_refused_cheaply(tmp_path: Path, item: Hostile) -> None:
    path = tmp_path / item.name
    path.write_bytes(item.build())
    start = time.process_time()
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError) as info:
            load_dataset(path, limits=LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert any(r in message for r in item.refused), message
    assert plain(message.replace(item.name, "")), message
    assert peak < 40 * MiB, peak
    assert time.process_time() - start < 3


# ---- fuzz


def _seeds() -> dict[str, bytes]:
    """Small valid datasets of every format, the fuzzer's starting points."""
    rng = np.random.default_rng(0)
    tar = tar_of(PAD)
    npz, npz_c = io.BytesIO(), io.BytesIO()
    x = rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)
    y = np.arange(6) % 2
    np.savez(npz, x=x, y=y, class_names=np.array(["a", "b"]))
    np.savez_compressed(npz_c, x=x / 255.0, y=y)
    return {
        "d.zip": zip_of(PAD),
        "d.tar": tar,
        "d.tar.gz": gzip.compress(tar),
        "d.tar.bz2": bz2.compress(tar),
        "d.tar.xz": lzma.compress(tar),
        "d.npz": npz.getvalue(),
        "dc.npz": npz_c.getvalue(),
    }


def mutate(data: bytes, rnd: random.Random) -> bytes:
    """1-6 seeded byte-level edits: flips, interesting values, inserts, deletes, copies,
    truncation (what a fuzzer does to find a parser's unchecked path)."""
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 6)):
        if not buf:
            buf = bytearray(b"\0")
        at = rnd.randrange(len(buf))
        op = rnd.randrange(6)
        if op == 0:
            buf[at] ^= 1 << rnd.randrange(8)
        elif op == 1:
            buf[at] = rnd.choice((0, 0xFF, 0x7F, 0x80, 0x01))
        elif op == 2:  # a little-endian length field set huge
            buf[at : at + 4] = rnd.choice((b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\0\0\0\x80"))
        elif op == 3:
            buf[at:at] = rnd.randbytes(rnd.randint(1, 64))
        elif op == 4:
            del buf[at : at + rnd.randint(1, 64)]
        else:
            size = rnd.randint(1, 512)
            buf[at:at] = buf[rnd.randrange(len(buf)) :][:size]
    if rnd.random() < 0.1:
        del buf[rnd.randrange(len(buf) + 1) :]
    return bytes(buf)


def test_fuzzed_datasets_load_or_fail_plainly(tmp_path: Path) -> None:
    """Seeded mutations of small valid files, for a bounded time: each loads (a dataset) or
    raises ``DatasetError`` with a plain message; the peak memory stays bounded."""
    seeds = _seeds()
    rnd = random.Random(21)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    deadline = time.monotonic() + 6
    outcomes: dict[str, int] = {"loaded": 0, "refused": 0}
    runs = 0
    while time.monotonic() < deadline or runs < 100:
        name, seed = rnd.choice(sorted(seeds.items()))
        data = mutate(seed, rnd)
        path = tmp_path / name
        path.write_bytes(data)
        try:
            ds = load_dataset(path, limits=LIMITS)
        except DatasetError as exc:
            assert plain(str(exc).replace(name, "")), (runs, name, str(exc))
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the finding: report the input that did it
            (tmp_path / f"finding-{runs}-{name}").write_bytes(data)
            raise AssertionError(f"run {runs} ({name}): {type(exc).__name__}: {exc}") from exc
        else:
            assert isinstance(ds, TargetDataset) and len(ds) >= 2
            outcomes["loaded"] += 1
        runs += 1
    assert outcomes["refused"] > 50 and outcomes["loaded"] > 5, outcomes
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert grown < 128 * MiB, grown
