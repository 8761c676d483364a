"""CUDA graphs of a hook's steady state (issue 19: ``cuda_graphs=True``).

On a GPU host the sparse hooks lose their time on the host, not on the device: each bucket
call launches a few dozen small kernels from Python inside DDP's autograd node, and a
ResNet-50 iteration at DDP's default 25 MB buckets pays that four times
(``benchmarks/results/comm_gpu_host.md``). In the steady state a bucket's work has fixed
shapes (fixed-capacity payloads, no host reads: see ``hostread``), so it can be captured once
as a CUDA graph and replayed with one launch per call.

What a graph may capture, and why the conditions below hold it to the eager result:

* **Inputs by address.** A graph reads and writes fixed addresses: the bucket's buffer (DDP
  keeps one per bucket until it rebuilds, and the key holds its address), the bucket's
  persistent flat residual and momentum (``ParamStore.flat``: ``gather`` hands back the same
  tensor while nothing else wrote the store), the state's scratch buffer and the tensors that
  the capture allocated in the graph's private pool. A replay first checks that the store
  still holds the captured flats (a checkpoint load or ``reset_state`` replaces them) and
  otherwise drops the graph and runs eagerly.
* **Same work every call.** Only at the target density (after any warm-up), with every
  parameter of the bucket used (``_hold_out`` depends on which were not), without
  ``sync_cuda_timing`` (it synchronises inside the step) and for a scheme whose steady state
  has no host-side control (``HookState.graphable``: spardl with one team, topk, gaussiank;
  exdyna and dfs steer thresholds and block sizes on the host each iteration).
* **The residual stays in place.** The captured step copies a residual that the exchange
  returned as a new tensor back into the persistent flat (``static=True`` of the driver's
  step), so the next replay reads what this one wrote.
* **Stats.** The amounts the step adds are recorded once at capture (sizes and byte counts
  are fixed), but a count the device computes is added, inside the graph, to a device
  vector of running totals that the stats read once an iteration (``CommStats.follow``):
  a replay does no host work for it, where reading each replay's count had cost a pinned
  copy, an event and its record per bucket. The replay is timed as
  a whole into ``select_s`` (selection and any collectives are one graph), but not every
  replay: see ``TIME_EVERY``.

A bucket runs eagerly for its first ``WARM_CALLS`` steady calls (lazy initialisation, the
Triton compile and the persistent flats happen there, not in the capture), is captured on the
next (``capture_error_mode="thread_local"``: DDP calls hooks from the autograd thread while
NCCL's watchdog polls from its own), then replayed. A capture that fails (an operation that
cannot be captured, an NCCL too old to capture collectives) warns once and leaves that bucket
eager for good: the option can only cost the capture attempt, never the result.

Collectives are captured with the rest (NCCL >= 2.9.6 supports it). Measured on one GPU, a
world of one (``benchmarks/comm/gpu_hooks.py``, labels ``+graph``); several GPUs are untested.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zoopick.training.comm import hostread, triton_kernels
from zoopick.training.comm.stats import FIELDS

if TYPE_CHECKING:
    from zoopick.training.comm.state import HookState
    from zoopick.training.comm.store import BucketLayout

_FIELD_AT = {name: i for i, name in enumerate(FIELDS)}

WARM_CALLS = 2
"""Eager steady calls of a bucket before it is captured."""

TIME_EVERY_DEFAULT = 16
TIME_EVERY = TIME_EVERY_DEFAULT
"""One replay in this many of a graph is timed with a pair of CUDA events; the others add
the time its last timed replay took (a replay is the same work every call). Timing every
replay cost more host time than the replay itself: each event is a new Python object, and
recording it looks the current stream up in Python (``torch.cuda.current_stream``), twice
a bucket, on the thread that also launches the backward pass (issue 19: run F's graphed
hooks spent 10-14x noop's host time per bucket, about all of their added time). With 1,
every replay is timed, as eager steps are."""

MAX_GRAPHS = 64
"""Graphs kept per state; a rebuild only adds keys, so past this all are dropped. (The
Triton kernels' cached device tables that a graph reads are kept by the graph itself:
``triton_kernels.holding``.)"""

# (state, buf, layout, density, static) -> None: the driver's step for a bucket whose
# parameters were all used (``state._step`` with the exchange bound)
Step = Callable[["HookState", torch.Tensor, "BucketLayout", float, bool], None]


class StatsRecorder:
    """Stands in for ``CommStats`` during a capture: keeps the numbers the step adds, to be
    added again after every replay, and adds its tensor amounts to ``totals`` (one element
    per field of ``stats.FIELDS``), in the graph being captured (see the module doc)."""

    def __init__(self, totals: torch.Tensor) -> None:
        self.numbers: dict[str, float] = {}
        self.totals = totals
        self.adds_to_totals = False  # whether the graph adds to them (else nothing to read)

    def add(self, **amounts: Any) -> None:
        for key, value in amounts.items():
            if isinstance(value, torch.Tensor):
                self.totals[_FIELD_AT[key]].add_(value.detach())
                self.adds_to_totals = True
            else:
                self.numbers[key] = self.numbers.get(key, 0) + value

    @contextmanager
    def timer(self, field: str) -> Iterator[None]:
        yield


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    residual: torch.Tensor
    momentum: torch.Tensor | None
    recorded: StatsRecorder
    # the state's buffers and device constants as captured, and the Triton kernels' cached
    # tables the capture read: held so that a buffer the state later replaces (a larger
    # scratch, a rebuilt block table) or a cache evicts is never freed under the graph
    kept: tuple[Any, ...] = ()
    # replay timing (``TIME_EVERY``): the events of the last timed replay until the device
    # passes them, what that replay took, and how many replays until the next timed one
    probe: tuple[Any, Any] | None = None
    seconds: float | None = None
    untimed: int = 0


@dataclass
class BucketGraphs:
    """A state's captured buckets, keyed by layout, buffer address, dtype and density."""

    graphs: dict[tuple[Any, ...], _Graph] = field(default_factory=dict)
    calls: dict[tuple[Any, ...], int] = field(default_factory=dict)
    failed: set[tuple[Any, ...]] = field(default_factory=set)
    captures: int = 0  # how many graphs were captured (tests, benchmarks)
    replays: int = 0
    # per device: the running totals the graphs' tensor amounts go to (``StatsRecorder``)
    totals: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        self.graphs.clear()
        self.calls.clear()

    def run(
        self,
        state: HookState,
        buf: torch.Tensor,
        layout: BucketLayout,
        unused: list[tuple[int, int]],
        density: float | None,
        step: Step,
    ) -> bool:
        """Replay (or capture, then replay) this bucket's step; False when the call must run
        eagerly instead (the caller then runs ``step`` itself)."""
        if not self._eligible(state, buf, unused, density):
            return False
        key = (layout.key, buf.data_ptr(), buf.dtype, density)
        entry = self.graphs.get(key)
        if entry is not None and not self._still_valid(state, layout, entry):
            del self.graphs[key]
            self.calls.pop(key, None)
            entry = None
        if entry is None:
            if key in self.failed:
                return False
            seen = self.calls.get(key, 0)
            if seen < WARM_CALLS:
                if len(self.calls) >= 4 * MAX_GRAPHS:  # keys of buckets rebuilt long ago
                    self.calls.clear()
                self.calls[key] = seen + 1
                return False
            entry = self._capture(state, buf, layout, density, step, key)
            if entry is None:
                return False
        self._replay(state, entry)
        self.replays += 1
        return True

    @staticmethod
    def _eligible(
        state: HookState, buf: torch.Tensor, unused: list[tuple[int, int]], density: float | None
    ) -> bool:
        """Whether this call's step is the steady state a graph replays (the module doc)."""
        return (
            buf.is_cuda
            and not unused
            and density is not None
            and density == state.density
            and state.graphable()
            and not state.stats.sync_cuda
        )

    @staticmethod
    def _replay(state: HookState, entry: _Graph) -> None:
        """Replay ``entry``, into ``select_s``: every ``TIME_EVERY``-th replay timed by CUDA
        events (added once the device has passed them, like any timed block), the others
        adding the last timed replay's time, read here when its end event has completed
        (a query, never a wait). Replays before the first reading add nothing."""
        stats = state.stats
        numbers = entry.recorded.numbers  # what the captured step added, every replay again
        probe = entry.probe
        if probe is not None and probe[1].query():
            entry.seconds = probe[0].elapsed_time(probe[1]) / 1000.0
            entry.probe = None
        if entry.untimed <= 0:
            start = hostread.recorded_event(state.device, timing=True)
            entry.graph.replay()
            end = hostread.recorded_event(state.device, timing=True)
            stats.add_elapsed("select_s", start, end)
            entry.probe = (start, end)
            entry.untimed = TIME_EVERY - 1
            if numbers:
                stats.add(**numbers)
            return
        entry.graph.replay()
        entry.untimed -= 1
        if entry.seconds is not None:
            stats.add(**numbers, select_s=entry.seconds)
        elif numbers:
            stats.add(**numbers)

    @staticmethod
    def _flats(state: HookState, layout: BucketLayout) -> tuple[Any, Any]:
        residual = state.residuals.flat(layout)
        momentum = state.momenta.flat(layout) if state.momentum > 0.0 else None
        return residual, momentum

    def _still_valid(self, state: HookState, layout: BucketLayout, entry: _Graph) -> bool:
        residual, momentum = self._flats(state, layout)
        return residual is entry.residual and momentum is entry.momentum

    def _capture(
        self,
        state: HookState,
        buf: torch.Tensor,
        layout: BucketLayout,
        density: float,
        step: Step,
        key: tuple[Any, ...],
    ) -> _Graph | None:
        residual, momentum = self._flats(state, layout)
        if residual is None or (state.momentum > 0.0 and momentum is None):
            return None  # not persistent yet: the next eager call makes them so
        if len(self.graphs) >= MAX_GRAPHS:
            self.clear()
        totals = self.totals.get(buf.device)
        if totals is None:  # made outside any capture: a graph adds to it, never zeroes it
            totals = torch.zeros(len(FIELDS), dtype=torch.float64, device=buf.device)
            self.totals[buf.device] = totals
        recorder = StatsRecorder(totals)
        stats, state.stats = state.stats, recorder  # type: ignore[assignment]
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                triton_kernels.holding() as tables,
                torch.cuda.graph(graph, capture_error_mode="thread_local"),
            ):
                step(state, buf, layout, density, True)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the bucket eager
            self.failed.add(key)
            warnings.warn(
                f"{state.name}: CUDA graph capture failed, this bucket runs eagerly: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        finally:
            state.stats = stats
            state.prescan = None
        if state.residuals.flat(layout) is not residual:  # the step rebound the store
            self.failed.add(key)
            return None
        kept = (*state.device_buffers(), *tables)
        entry = _Graph(graph, residual, momentum, recorder, kept)
        if recorder.adds_to_totals:  # else an iteration's read of them costs host time for 0
            stats.follow(totals)
        self.graphs[key] = entry
        self.captures += 1
        return entry
