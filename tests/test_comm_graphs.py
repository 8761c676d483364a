"""CUDA graphs of the hooks' steady state (issue 19, ``cuda_graphs=True``; ``graphs.py``).

On the CPU (CI): which hooks may ask for graphs (options naming the problem otherwise), the
captured step's one difference (the residual written back into the stored flat tensor) gives
the eager results, the graph path declines CPU buffers, and the stats recorder replays what
a capture added. On CUDA (skipped without a GPU; a lent one ran them, see
``benchmarks/results/gpu_logs/``): replayed graphs give the eager run's updates and residuals,
with no synchronising call once captured, through a checkpoint reload (the graphs are
dropped and captured again) and in a real DDP model.
"""

from __future__ import annotations

import pytest
import torch

import zoopick.training.comm as comm
from tests import comm_harness
from zoopick.training.comm import graphs
from zoopick.training.comm import state as state_mod
from zoopick.training.comm.store import BucketLayout

SHAPES = [(40, 25), (300,), (63,), (500,)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def world_of_one():
    """A process group of one: NCCL on a GPU, gloo otherwise."""
    yield from comm_harness.world_of_one(torch.cuda.is_available())


# -- options (no torch.distributed needed) ------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "options", "why"),
    [
        ("exdyna", {}, "exdyna steers"),
        ("dfs", {}, "dfs resizes"),
        ("spardl", {"teams": 2}, "teams > 1"),
    ],
)
def test_graphs_refused_where_the_host_steers(name, options, why):
    with pytest.raises(comm.CommError, match=f"cuda_graphs.*{why}"):
        comm.check_options(name, cuda_graphs=True, **options)


@pytest.mark.parametrize("name", ["topk", "gaussiank", "spardl"])
def test_graphs_accepted_and_off_by_default(name):
    comm.check_options(name, cuda_graphs=True)
    assert comm.get(name).options["cuda_graphs"] is False


def test_recorder_sums_numbers_and_adds_tensors_to_the_totals():
    from zoopick.training.comm.stats import FIELDS

    totals = torch.zeros(len(FIELDS), dtype=torch.float64)
    rec = graphs.StatsRecorder(totals)
    with rec.timer("select_s"):
        rec.add(bytes_sent=10, nnz=torch.tensor(3))
        rec.add(bytes_sent=5, numel=7, nnz=torch.tensor(2))
    assert rec.numbers == {"bytes_sent": 15, "numel": 7}
    assert totals.tolist() == [5.0 if f == "nnz" else 0.0 for f in FIELDS]
    assert rec.adds_to_totals  # so the stats follow them
    numbers_only = graphs.StatsRecorder(torch.zeros(len(FIELDS), dtype=torch.float64))
    numbers_only.add(bytes_sent=10)
    assert not numbers_only.adds_to_totals  # nothing to read an iteration: not followed


def test_running_totals_are_counted_once_an_iteration():
    """What a CUDA graph adds to its running totals (``StatsRecorder`` inside the graph; here
    the same adds done directly, on the CPU) reaches the record of the iteration it was added
    in, once, and the totals start that iteration's successor from zero."""
    from zoopick.training.comm.stats import FIELDS, CommStats

    totals = torch.zeros(len(FIELDS), dtype=torch.float64)
    stats = CommStats()
    stats.follow(totals)
    stats.follow(totals)  # one vector is followed once
    recorder = graphs.StatsRecorder(totals)
    for it, per_replay in enumerate([(3, 4), (5,), ()]):
        stats.begin(it, torch.device("cpu"))
        for count in per_replay:  # one replay of a bucket's graph each
            recorder.add(nnz=torch.tensor(count), bytes_sent=torch.tensor(2.5))
            stats.add(buckets=1)
        stats.finish()
        assert not totals.any()
    assert [r["nnz"] for r in stats] == [7, 5, 0]
    assert [r["bytes_sent"] for r in stats] == [5.0, 2.5, 0.0]
    assert [r["buckets"] for r in stats] == [2, 1, 0]
    assert stats.cumulative["nnz"] == 12 and stats.cumulative["bytes_sent"] == 7.5


class _ClockEvent:
    """Stands in for a CUDA event on a CPU, on a device clock that only a replay moves
    (``_StepGraph``): recorded at the clock's reading, always complete."""

    now = 0.0  # ms
    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.at: float | None = None

    @classmethod
    def recorded(cls, device: torch.device, *, timing: bool = False) -> _ClockEvent:
        """``hostread.recorded_event`` on this clock."""
        assert timing
        event = cls()
        event.record()
        return event

    def record(self) -> None:
        self.at = type(self).now

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: _ClockEvent) -> float:
        return end.at - self.at


class _StepGraph:
    """A graph whose replay takes ``ms`` on the device clock."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def replay(self) -> None:
        _ClockEvent.now += self.ms


@pytest.mark.parametrize(("every", "pairs"), [(16, 3), (1, 40)])
def test_replays_are_timed_one_in_time_every(monkeypatch, every, pairs):
    """Every replay's time reaches ``select_s`` (a timed one's from its events, the others'
    from the last timed one), while only one replay in ``TIME_EVERY`` makes a pair of
    events: 40 replays of a 2 ms graph are 80 ms from 3 pairs (or 40 with ``TIME_EVERY``
    1, every replay timed as an eager step is)."""
    from zoopick.training.comm import hostread

    monkeypatch.setattr(hostread, "recorded_event", _ClockEvent.recorded)
    monkeypatch.setattr(graphs, "TIME_EVERY", every)
    monkeypatch.setattr(_ClockEvent, "made", 0)
    st, _ = comm.make_hook("spardl", density=0.05)
    totals = torch.zeros(len(comm.stats.FIELDS), dtype=torch.float64)
    entry = graphs._Graph(_StepGraph(2.0), torch.zeros(1), None, graphs.StatsRecorder(totals))
    for it in range(10):
        st.stats.begin(it, torch.device("cuda"))
        for _ in range(4):  # four calls an iteration, as four buckets would be
            graphs.BucketGraphs._replay(st, entry)
        st.stats.finish()
    st.stats.resolve()
    assert st.stats.cumulative["select_s"] == pytest.approx(0.080)
    assert _ClockEvent.made == 2 * pairs
    per_iteration = [rec["select_s"] for rec in st.stats]
    assert per_iteration == pytest.approx([0.008] * 10)


# -- the captured step on the CPU ---------------------------------------------------------------
def _drive(name: str, options: dict, static: bool, iters: int = 5):
    """Call the driver's step directly on one persistent bucket, as a capture would
    (``static``) or eagerly: (outputs, final residual, the stored flat tensor's id per
    iteration)."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.zeros(s) for s in SHAPES]
    st, _ = comm.make_hook(name, density=0.05, **options)
    bucket = comm.SimpleBucket(params)
    layout = BucketLayout.of(bucket)
    exchange = {
        "topk": comm.topk._exchange,
        "gaussiank": comm.gaussiank._exchange,
        "spardl": comm.spardl._exchange,
    }[name]
    outs, flats = [], []
    for it in range(iters):
        bucket.set_gradients([torch.randn(s, generator=gen) for s in SHAPES])
        st.stats.begin(it, torch.device("cpu"))
        state_mod._step(st, bucket.buffer(), layout, [], exchange, st.density_at(it), static=static)
        st.stats.finish()
        st.iteration += 1
        outs.append(bucket.buffer().clone())
        flats.append(id(st.residuals.flat(layout)))
    return outs, st.residuals.gather(layout, torch.device("cpu")).clone(), flats


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("topk", {}),
        ("gaussiank", {}),
        ("spardl", {"momentum": 0.9}),
        ("spardl", {"warmup": 2, "warmup_mode": "dense"}),  # dense_exchange: a new residual
    ],
)
def test_static_step_equals_the_eager_step(world_of_one, name, options):
    eager_outs, eager_res, eager_flats = _drive(name, options, static=False)
    outs, res, flats = _drive(name, options, static=True)
    for a, b in zip(eager_outs, outs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(eager_res, res)
    # the captured step keeps the residual where it was: one flat tensor from the start
    assert len(set(flats)) == 1
    if options.get("warmup_mode") == "dense":  # where eagerly the store is rebound
        assert len(set(eager_flats)) > 1


def test_graphs_decline_cpu_buffers(world_of_one):
    st, hook = comm.make_hook("spardl", density=0.05, cuda_graphs=True)
    params = [torch.zeros(s) for s in SHAPES]
    bucket = comm.SimpleBucket(params)
    gen = torch.Generator().manual_seed(2)
    for _ in range(graphs.WARM_CALLS + 3):
        bucket.set_gradients([torch.randn(s, generator=gen) for s in SHAPES])
        hook(st, bucket).wait()
    assert st.graphs.captures == 0 and st.graphs.replays == 0 and not st.graphs.calls


def test_a_graph_keeps_every_buffer_the_step_uses(world_of_one):
    """What a captured graph holds alive (``HookState.device_buffers``): the scratch
    buffers and, for spardl, its block tables, the ones the step has built."""
    for name in ("topk", "spardl"):
        st, hook = comm.make_hook(name, density=0.05)
        bucket = comm.SimpleBucket([torch.zeros(s) for s in SHAPES])
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            bucket.set_gradients([torch.randn(s, generator=gen) for s in SHAPES])
            hook(st, bucket).wait()
        kept = {id(b) for b in st.device_buffers()}
        built = list(st._scratch.values()) + list(getattr(st, "blocks", {}).values())
        assert built, f"{name}: the step built no buffer to check"
        assert {id(b) for b in built} <= kept
        assert len(kept) == len(built)


# -- CUDA ---------------------------------------------------------------------------------------
CUDA_CONFIGS = {
    "topk": ("topk", {}, False),
    "gaussiank": ("gaussiank", {}, False),
    "gaussiank_triton": ("gaussiank", {}, True),
    "spardl_momentum": ("spardl", {"momentum": 0.9}, False),
    "spardl_triton": ("spardl", {}, True),
    "spardl_async": ("spardl", {"async_comm": True}, False),
    "gaussiank_async_fp16": ("gaussiank", {"async_comm": True, "fp16": True}, False),
}
ITERS, RELOAD_AT = 12, 7


def _run_buckets(name: str, options: dict, graphed: bool):
    """Two persistent buckets on the GPU, new gradients every iteration, a checkpoint
    round trip at ``RELOAD_AT``: (outputs per iteration, residuals, the state). Guarded
    against synchronising calls from the first replay on, except the reload's."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.zeros(s, device="cuda") for s in SHAPES]
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"p{i}", torch.nn.Parameter(p))
    params = list(model.parameters())
    st, hook = comm.make_hook(name, density=0.05, cuda_graphs=graphed, **options)
    buckets = [
        comm.SimpleBucket(params[:2], index=0, is_last=False),
        comm.SimpleBucket(params[2:], index=1, is_last=True),
    ]
    outs = []
    for it in range(ITERS):
        grads = [torch.randn(s, generator=gen).cuda() for s in SHAPES]
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # as DDP leaves it: a parameter without one counts as unused
        buckets[0].set_gradients(grads[:2])
        buckets[1].set_gradients(grads[2:])
        if it == RELOAD_AT:
            st.load_state_dict(model, st.state_dict(model))
        torch.cuda.synchronize()
        guard = graphed and it > graphs.WARM_CALLS and it not in range(RELOAD_AT, RELOAD_AT + 3)
        if guard:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs.append([hook(st, b).wait().clone() for b in buckets])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    residuals = [st.residuals.get(p).clone() for p in params]
    return outs, residuals, st


@cuda
@pytest.mark.parametrize("key", list(CUDA_CONFIGS))
def test_graphs_replay_the_eager_steps(world_of_one, monkeypatch, key):
    from zoopick.training.comm import select

    name, options, triton = CUDA_CONFIGS[key]
    monkeypatch.setattr(select, "CUDA_TRITON", triton)
    eager_outs, eager_res, eager = _run_buckets(name, options, graphed=False)
    outs, res, st = _run_buckets(name, options, graphed=True)
    for it, (a, b) in enumerate(zip(eager_outs, outs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"iteration {it}"
    for x, y in zip(eager_res, res, strict=True):
        assert torch.equal(x, y)
    assert not st.graphs.failed
    # captured twice per bucket: before the reload and after it (the flats were replaced)
    assert st.graphs.captures == 4
    assert st.graphs.replays >= 2 * (ITERS - 2 * (graphs.WARM_CALLS + 1))
    st.stats.resolve()  # a graphed run's stats count every bucket of every iteration
    assert st.stats.cumulative["buckets"] == 2 * ITERS
    assert st.stats.cumulative["numel"] == ITERS * sum(torch.Size(s).numel() for s in SHAPES)
    eager.stats.resolve()  # the counts the device makes (running totals in the graphs)
    for field in ("nnz", "bytes_sent", "bytes_recv"):
        assert st.stats.cumulative[field] == eager.stats.cumulative[field], field
    if triton:  # the kernels' cached tables that a graph reads are kept by the graph
        from zoopick.training.comm import triton_kernels as tk

        wanted = (tk.Spans, tk.BracketPlan) if name == "spardl" and tk.BRACKET else (tk.Spans,)
        for entry in st.graphs.graphs.values():
            assert all(any(isinstance(t, cls) for t in entry.kept) for cls in wanted)


@cuda
def test_graphs_in_a_ddp_model(world_of_one):
    """A real DDP model (several buckets, rebuilt after the first iteration) trains to the
    same weights with graphed and eager spardl."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    def train(graphed: bool):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 8 * 8, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        ).cuda()
        ddp = DDP(net, device_ids=[0], bucket_cap_mb=0.05)
        st, hook = comm.make_hook("spardl", density=0.05, cuda_graphs=graphed)
        ddp.register_comm_hook(st, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(10):
            x = torch.randn(8, 3, 12, 12, device="cuda", generator=gen)
            y = torch.randint(0, 10, (8,), device="cuda", generator=gen)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return [p.detach().clone() for p in net.parameters()], st

    eager, _ = train(False)
    graphed, st = train(True)
    assert st.graphs.captures >= 2 and st.graphs.replays > 0 and not st.graphs.failed
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a, b)
