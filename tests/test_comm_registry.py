"""Hook registry and ``make_hook``: names, options, and the errors for bad ones (no process
group needed: states resolve the group lazily)."""

from __future__ import annotations

import pytest

import zoopick.training.comm as comm
from zoopick.training.comm.dense import DenseState
from zoopick.training.comm.spardl import SparDLState


def test_available_lists_every_hook():
    assert comm.available() == ["dense", "dfs", "exdyna", "gaussiank", "spardl", "topk"]


@pytest.mark.parametrize("name", ["dfs", "exdyna", "gaussiank", "spardl", "topk"])
def test_sparse_hooks_share_the_common_options(name):
    options = comm.get(name).options
    for common in ("density", "warmup", "warmup_mode", "momentum", "fp16"):
        assert common in options
    state, hook = comm.make_hook(name, density=0.2, warmup=3, momentum=0.9, fp16=True)
    assert (state.density, state.warmup, state.momentum, state.fp16) == (0.2, 3, 0.9, True)
    assert callable(hook) and hook is comm.get(name).hook


def test_make_hook_passes_scheme_options():
    state, _ = comm.make_hook("spardl", density=0.05, teams=2, split="pow2")
    assert isinstance(state, SparDLState)
    assert (state.teams, state.split, state.density) == (2, "pow2", 0.05)
    state, _ = comm.make_hook("dense")
    assert isinstance(state, DenseState)


def test_unknown_hook_names_it_and_lists_the_others():
    with pytest.raises(comm.CommError, match="'nope'") as err:
        comm.make_hook("nope")
    assert "topk" in str(err.value) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("name", "options", "bad"),
    [
        ("topk", {"teams": 2}, "'teams'"),
        ("dense", {"warmup": 2}, "'warmup'"),
        ("exdyna", {"blocks": 8, "bogus": 1}, "'bogus'"),
    ],
)
def test_unknown_option_is_named(name, options, bad):
    with pytest.raises(comm.CommError, match=bad):
        comm.make_hook(name, **options)


@pytest.mark.parametrize(
    ("name", "options", "what"),
    [
        ("topk", {"density": 0.0}, "density"),
        ("topk", {"density": 1.5}, "density"),
        ("topk", {"warmup": -1}, "warmup"),
        ("topk", {"warmup_mode": "linear"}, "warmup_mode"),
        ("topk", {"momentum": 1.0}, "momentum"),
        ("spardl", {"teams": 0}, "teams"),
        ("spardl", {"split": "thirds"}, "split"),
        ("exdyna", {"blocks": 0}, "blocks"),
        ("gaussiank", {"refine": -1}, "refine"),
        ("dfs", {"block_size": 512}, "block_size"),
        ("dfs", {"grow_at": 0.1, "shrink_at": 0.2}, "shrink_at"),
    ],
)
def test_invalid_option_values_raise(name, options, what):
    with pytest.raises(comm.CommError, match=what):
        comm.make_hook(name, **options)


def test_spec_summary_comes_from_the_hook_docstring():
    assert "top-k" in comm.get("topk").summary


def test_each_hook_is_declared_once_and_its_state_reads_every_option():
    """``training.comm_options.HOOKS`` (torch-free, what the API validates with) is the one
    declaration: the registry's names and options are its, and each state class reads every
    option its model declares (an option declared and never read would do nothing)."""
    from zoopick.training import comm_options

    assert comm_options.names() == comm.available()
    elsewhere = {"sync_cuda_timing": lambda s: s.stats.sync_cuda,
                 "cuda_graphs": lambda s: s.graphs is not None}  # fmt: skip
    for name in comm.available():
        model = comm_options.options_model(name)
        declared = {k: f.default for k, f in model.model_fields.items()}
        assert declared == comm.get(name).options, name
        state, _ = comm.make_hook(name, density=declared["density"])
        assert isinstance(state.options, model), name
        for option, default in declared.items():
            read = elsewhere.get(option, lambda s, o=option: getattr(s, o))
            assert read(state) == default, (name, option)


def test_build_takes_validated_options_and_checks_them_no_more():
    """``build`` is ``make_hook`` for options validated before: the state gets that object."""
    from zoopick.training import comm_options

    options = comm_options.validate("spardl", density=0.05, options={"teams": 2})
    state, hook = comm.build("spardl", options)
    assert state.options is options and (state.teams, state.density) == (2, 0.05)
    assert hook is comm.get("spardl").hook
    with pytest.raises(TypeError, match="SparDLOptions"):
        comm.build("spardl", comm_options.validate("topk", density=0.05, options={}))


def test_options_validate_without_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from zoopick.training import comm_options as c\n"
        "c.validate('spardl', density=0.1, options={'teams': 2})\n"
        "try:\n"
        "    c.validate('spardl', density=0.1, options={'teams': 0})\n"
        "except c.CommError as e:\n"
        "    assert 'teams' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('teams=0 accepted')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
