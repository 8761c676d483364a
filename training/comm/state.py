"""The state every hook carries, and the driver that wraps a scheme's exchange step.

The driver does what all error-feedback schemes share, so each hook module only implements
"given the accumulated gradient ``acc`` of this bucket, what is summed over the workers and
what stays behind":

1. open the iteration's stats record (closed after ``bucket.is_last()``);
2. ``acc = residual + u`` where ``u`` is the gradient, or with ``momentum = m > 0`` the
   DGC-style local momentum ``u <- m u + g`` (momentum correction, Lin et al. 2018: use it with
   a momentum-free optimizer);
3. the scheme's exchange: returns the summed update over all workers (identical on every
   rank), this worker's new residual and the positions it sent, as indices or a boolean
   mask (for momentum factor masking: ``u`` is zeroed there);
4. the bucket buffer becomes the sum divided by P (the average, like DDP's default), and
   residuals are stored per parameter (see ``store.py``).

Warm-up (``warmup = W`` iterations, as in DGC): with ``warmup_mode="exp"`` the density at
iteration t < W is ``max(density, 0.25 ** (t + 1))`` (25 %, 6.25 %, 1.56 %, ... then the
target); with ``warmup_mode="dense"`` the first W iterations are dense all-reduces of ``acc``
(residuals are flushed into them; with ``fp16`` each worker keeps its own rounding, the
half-precision sum's rounding is not fed back).

``async_comm=True`` lets communication overlap the rest of the backward pass (see
``run_hook``): on CUDA each bucket's work is enqueued on a side stream of the state's own and
the returned future completes there (DDP's stream waits for it, the host never does); on
the CPU it runs on one FIFO communication thread per state.

Timing never stalls the device by default: ``sync_cuda_timing=False`` times CUDA work with
events (see ``stats.CommStats``); ``True`` synchronises around each timed block, for
benchmarks that want wall time per block and accept the stall.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zoopick.training.comm import select, triton_kernels
from zoopick.training.comm.exchange import PairSum, allreduce_sum, to_wire
from zoopick.training.comm.graphs import BucketGraphs
from zoopick.training.comm.prescan import Prescan, accumulate
from zoopick.training.comm.stats import CommStats
from zoopick.training.comm.store import BucketLayout, ParamStore
from zoopick.training.comm_options import SparseOptions

if TYPE_CHECKING:
    from zoopick.training.comm.cpu_kernels import Scan

# An exchange step: (state, layout, acc, density) -> (sum over workers, residual, sent
# positions). The sum is a dense tensor or a ``PairSum``; the sent positions are read only
# with ``momentum > 0`` (a scheme may skip them, returning None, when momentum is off).
Exchange = Callable[
    ["HookState", BucketLayout, torch.Tensor, float],
    tuple[torch.Tensor | PairSum, torch.Tensor, torch.Tensor | None],
]


class HookState:
    """Options, per-parameter residual/momentum stores, stats and the iteration counter."""

    name = "base"

    def __init__(
        self, options: SparseOptions, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """``options`` validated where they entered (``comm_options.validate``): read, not
        checked again."""
        self.options = options
        self.process_group = process_group
        self.density = float(options.density)
        self.warmup = options.warmup
        self.warmup_mode = options.warmup_mode
        self.momentum = float(options.momentum)
        self.fp16 = options.fp16
        self.async_comm = options.async_comm
        # CUDA graphs of the buckets' steady-state steps (graphs.py); None: always eager
        self.graphs = BucketGraphs() if options.cuda_graphs else None
        self._comm_thread: ThreadPoolExecutor | None = None
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[tuple[int, ...], BucketLayout] = {}  # see BucketLayout.of
        if self.async_comm and process_group is None and dist.is_initialized():
            # a group of our own: DDP's collectives on the default group (e.g. the unused-
            # parameter map) are issued from the main thread and must not interleave with
            # ours in a different order on different ranks
            self.process_group = dist.new_group(list(range(dist.get_world_size())))
        self.residuals = ParamStore()
        self.momenta = ParamStore()
        self.stats = CommStats(sync_cuda=options.sync_cuda_timing)
        self.iteration = 0
        self.device = torch.device("cpu")
        # the column maxima or candidates of the bucket being exchanged (CPU; see _run)
        self.prescan: Prescan | Scan | triton_kernels.Scan | None = None

    # -- group ---------------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def global_rank(self, group_rank: int) -> int:
        if self.process_group is None or self.process_group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def scratch(self, device: torch.device, numel: int) -> torch.Tensor:
        """A float32 work buffer of at least ``numel`` elements, kept across calls: a fresh
        10M-element temporary on a CPU costs its page faults on every call (the allocator
        hands large blocks back to the OS). One per device and state: a state's buckets are
        processed one at a time (in call order, or in stream order on CUDA), and a caller
        must not keep a view of it past its own step."""
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]

    def scan_spans(self, numel: int, density: float) -> list[tuple[int, int]] | None:
        """The blocks ``[lo, hi)`` of a bucket of ``numel`` elements whose selection takes
        the grouped scan, for the driver's one-pass error feedback (``prescan``); None
        (the default) when the scheme's sum is not a ``PairSum`` written into a zeroed
        bucket. An empty list still gets the fused pass, without maxima."""
        return None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The state's own CUDA stream on ``device`` (see ``run_hook``)."""
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device)
        return stream

    def graphable(self) -> bool:
        """Whether the steady-state step is the same device work every call, with no
        host-side control between iterations, so it can be replayed as a CUDA graph
        (``graphs.py``). Schemes that steer on the host (thresholds, partitions, block sizes
        read back one iteration later) say False."""
        return True

    def device_buffers(self) -> list[Any]:
        """The work buffers a step reads or writes besides the bucket and the stores: a
        captured CUDA graph replays into their memory, so it keeps them alive (a buffer
        replaced later is never freed while a graph might replay into it). A scheme with
        tables of its own adds them."""
        return list(self._scratch.values())

    # -- schedule ------------------------------------------------------------------------------
    def density_at(self, iteration: int) -> float | None:
        """Density used at ``iteration``; ``None`` means a dense all-reduce (dense warm-up)."""
        if iteration < self.warmup:
            if self.warmup_mode == "dense":
                return None
            return max(self.density, 0.25 ** (iteration + 1))
        return self.density

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Residuals, momenta and the iteration counter, by parameter name of ``model`` (what a
        resumed run needs to continue the same error-feedback sequence)."""
        names = {id(p): n for n, p in model.named_parameters()}
        self.settle()
        return {
            "iteration": self.iteration,
            "residuals": self.residuals.named(names),
            "momenta": self.momenta.named(names),
            "scheme": self.scheme_state(names),
        }

    def load_state_dict(self, model: torch.nn.Module, blob: dict[str, Any]) -> None:
        params = dict(model.named_parameters())
        self.iteration = int(blob["iteration"])
        self.residuals.load_named(params, blob["residuals"])
        self.momenta.load_named(params, blob["momenta"])
        self.load_scheme_state(params, blob.get("scheme", {}))  # absent in older checkpoints

    def settle(self) -> None:
        """Apply the control steps still waiting for a deferred read (``hostread``): a host
        read, for checkpoints and inspection, never needed by training itself."""

    def scheme_state(self, names: dict[int, str]) -> dict[Any, Any]:
        """A scheme's own per-bucket state (thresholds, partitions, block sizes) keyed by
        :func:`named_key`; none in the base class."""
        return {}

    def load_scheme_state(self, params: dict[str, torch.Tensor], blob: dict[Any, Any]) -> None:
        """Inverse of :meth:`scheme_state`."""

    def reset_state(self) -> None:
        """Drop residuals, momenta and scheme state (stats are kept)."""
        self.residuals.clear()
        self.momenta.clear()
        if self.graphs is not None:
            self.graphs.clear()


def named_key(key: tuple[int, ...], names: dict[int, str]) -> tuple[Any, ...]:
    """A bucket key (``BucketLayout.key``: parameter ids + numel) with names for the ids, so
    it survives a restart."""
    return tuple(names[i] for i in key[:-1]) + (key[-1],)


def id_key(named: tuple[Any, ...], params: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """Inverse of :func:`named_key` for the parameters of a rebuilt model."""
    return tuple(id(params[n]) for n in named[:-1]) + (int(named[-1]),)


def dense_exchange(
    state: HookState, layout: BucketLayout, acc: torch.Tensor, density: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sum ``acc`` by all-reduce; nothing stays behind."""
    payload, seen = to_wire(acc, state.fp16)
    total = allreduce_sum(state, payload.clone()).float()
    state.stats.add(nnz=acc.numel())
    return total, acc - seen, None


def _hold_out(slots: list[tuple[int, int]], acc: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Take the residual of parameters this rank did not use (``slots`` from
    ``_unused_slots``) out of ``acc`` (zeroing it there) and return it with its offsets, to
    be put back into the residual after the exchange.

    With ``find_unused_parameters=True`` DDP zero-fills an unused parameter's gradient in the
    bucket and, if no rank used it, never copies the reduced bucket into ``param.grad``: a
    residual sent for it would be neither applied nor kept. A locally unused parameter is
    recognised without a device sync by ``param.grad is None`` at hook time (DDP's default
    ``gradient_as_bucket_view=False`` with ``zero_grad(set_to_none=True)``, the default);
    with ``set_to_none=False`` or bucket views the gradient is always defined and the
    residual of a globally unused parameter is still lost. Holding out only this rank's share
    is safe either way: a parameter used elsewhere still receives the other ranks' updates,
    and this rank's residual waits for an iteration in which it uses the parameter."""
    held: list[tuple[int, torch.Tensor]] = []
    for off, length in slots:
        held.append((off, acc[off : off + length].clone()))
        acc[off : off + length] = 0.0
    return held


def run_hook(
    state: HookState, bucket: dist.GradBucket, exchange: Exchange
) -> torch.futures.Future[torch.Tensor]:
    """Common body of the error-feedback hooks (see the module docstring).

    With ``async_comm=True`` on the CPU the work of a bucket runs on the state's one FIFO
    communication thread and the returned future completes there, so the backward pass
    computes the next buckets while this one communicates. DDP calls the hook bucket by
    bucket in the same order on every rank, and one thread runs them in call order, so every
    rank issues its collectives in the same order (chained gloo callbacks, as PowerSGD does
    them, did not: they deadlocked here). The collectives use a process group of the state's
    own. What must be read at call time (the bucket's layout, which parameters this rank left
    unused) is read before handing over.

    On CUDA with ``async_comm=True`` no thread is needed: the hook never waits for the device
    (fixed-capacity payloads, deferred host reads), so it enqueues the bucket's selection and
    collectives on the state's side stream, after the gradient is ready (the side stream
    waits on the current one), and returns a CUDA future completed on that stream. DDP's
    stream waits for the future's event, not the host, and the backward kernels of the next
    buckets run beside this bucket's work (the pattern of torch's PowerSGD hook, whose work
    is chained on the collective's stream)."""
    buf = bucket.buffer()
    layout = BucketLayout.of(bucket, state._layouts)
    unused = _unused_slots(layout)
    is_last = bucket.is_last()
    if state.async_comm and buf.is_cuda:
        return _on_side_stream(
            state, buf.device, lambda: _run(state, buf, layout, unused, is_last, exchange)
        )
    if not state.async_comm:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(_run(state, buf, layout, unused, is_last, exchange))
        return fut
    if state._comm_thread is None:
        state._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoopick-comm")
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def work() -> None:
        try:
            result = _run(state, buf, layout, unused, is_last, exchange)
        except BaseException as exc:  # handed to DDP, which re-raises it in backward
            out.set_exception(exc)
        else:
            out.set_result(result)

    state._comm_thread.submit(work)
    return out


def _on_side_stream(
    state: HookState, device: torch.device, work: Callable[[], torch.Tensor]
) -> torch.futures.Future[torch.Tensor]:
    """``work()`` enqueued on the state's side stream; the future's CUDA event is recorded on
    that stream when ``set_result`` runs inside it (see ``run_hook``)."""
    side = state.side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[device])
    with torch.cuda.stream(side):
        fut.set_result(work())
    return fut


def _unused_slots(layout: BucketLayout) -> list[tuple[int, int]]:
    """(offset, length) of the parameters this rank did not use (see ``_hold_out_unused``).
    Every call of every bucket asks, and the answer is nearly always none: that is checked
    first with one attribute read a parameter (half the host time of the full test, which a
    GPU host pays on the thread launching the backward pass, issue 19)."""
    for p in layout.params:
        if p.grad is None:
            break
    else:
        return []
    return [
        (off, length)
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True)
        if length and p.requires_grad and p.grad is None
    ]


def _prescan_spans(
    state: HookState, buf: torch.Tensor, u: torch.Tensor, density: float | None
) -> list[tuple[int, int]] | None:
    """The blocks for ``prescan.accumulate`` or ``cpu_kernels.accumulate`` (one pass instead
    of the separate ones), or None for the plain ``acc.add_(u)``: only on the CPU's grouped
    or compiled path (the compiled one where the scheme names a block), for a
    scheme that names its blocks (its sum is a ``PairSum``, written into a zeroed bucket),
    outside a dense warm-up, when ``u`` is the bucket's own float32 gradient (no momentum),
    which the pass zeroes once it is read. On CUDA with ``select.cuda_triton()`` the pass is
    ``triton_kernels.accumulate``."""
    on_cpu = select.cpu_shortcut(buf) and (select.CPU_GROUPED or select.CPU_KERNEL)
    if density is None or not (on_cpu or triton_kernels.applies(buf)):
        return None
    if buf.dtype != torch.float32 or u.data_ptr() != buf.data_ptr() or not u.is_contiguous():
        return None
    return state.scan_spans(buf.numel(), density)


def _run(
    state: HookState,
    buf: torch.Tensor,
    layout: BucketLayout,
    unused: list[tuple[int, int]],
    is_last: bool,
    exchange: Exchange,
) -> torch.Tensor:
    """One bucket: the iteration's stats record around :func:`_step`, replayed from a CUDA
    graph where ``state.graphs`` has (or can capture) one for this bucket."""
    state.device = buf.device
    stats = state.stats
    stats.begin(state.iteration, buf.device)
    density = state.density_at(state.iteration)

    def step(st: HookState, b: torch.Tensor, lay: BucketLayout, d: float, static: bool) -> None:
        _step(st, b, lay, [], exchange, d, static)

    if state.graphs is None or not state.graphs.run(state, buf, layout, unused, density, step):
        _step(state, buf, layout, unused, exchange, density)
    if is_last:
        stats.finish()
        state.iteration += 1
    return buf


def _step(
    state: HookState,
    buf: torch.Tensor,
    layout: BucketLayout,
    unused: list[tuple[int, int]],
    exchange: Exchange,
    density: float | None,
    static: bool = False,
) -> None:
    """Error feedback, the scheme's exchange and the average written into ``buf``.
    ``static`` (a CUDA graph's capture, ``graphs.py``): the residual is written back into
    the stored flat tensor, so the next replay finds it at the same address."""
    stats = state.stats
    zeroed = False  # whether buf holds zeros now (its gradient is in acc)
    with stats.timer("select_s"):
        grad = buf.detach().float()
        if state.momentum > 0.0:
            u = state.momenta.gather(layout, buf.device).mul_(state.momentum).add_(grad)
        else:
            u = grad
        acc = state.residuals.gather(layout, buf.device)
        spans = _prescan_spans(state, buf, u, density)
        if spans is None:
            acc.add_(u)
        elif triton_kernels.applies(buf):  # CUDA: one Triton pass, the selection's first look
            state.prescan = triton_kernels.accumulate(acc, u, spans, keep=not unused)
            zeroed = True
        else:  # the same sums, with buf zeroed and the selection's scan on the way
            kernels = select.cpu_kernels(buf) if spans else None
            if kernels is None:  # the grouped scan's column maxima (torch)
                state.prescan = accumulate(acc, u, spans)
            else:  # the compiled pass's candidates (numba)
                state.prescan = kernels.accumulate(acc, u, spans, density)
            zeroed = True
    held = _hold_out(unused, acc)
    if state.prescan is not None:  # what the pass kept of those values is stale
        for off, values in held:
            state.prescan.changed(off, off + values.numel())
    try:
        if density is None:
            total, residual, sent = dense_exchange(state, layout, acc, 1.0)
        else:
            total, residual, sent = exchange(state, layout, acc, density)
    finally:
        state.prescan = None
    for off, values in held:
        residual[off : off + values.numel()].add_(values)
    if static and residual is not acc:
        residual = acc.copy_(residual)
    state.residuals.scatter(layout, residual)
    if state.momentum > 0.0:
        if sent is None:  # everything was sent
            u.zero_()
        elif sent.dtype == torch.bool:  # a mask (no boolean indexing: that is a host sync)
            u.masked_fill_(sent, 0.0)
        else:
            u.index_fill_(0, sent, 0.0)
        state.momenta.scatter(layout, u)
    stats.add(numel=acc.numel(), buckets=1)
    if isinstance(total, PairSum):  # the gradient in buf is spent (acc holds it): overwrite
        total.write(buf, state.size, zeroed=zeroed)
    else:
        buf.copy_(total.div_(state.size))
