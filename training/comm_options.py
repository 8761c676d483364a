"""The comm hooks' one declaration, without torch: :data:`HOOKS`, each hook's name, its options
and where its implementation is. What a job submission, ``zoopick train`` and
:func:`zoopick.training.comm.make_hook` validate a hook's options against, and what the
registry (``training/comm/registry.py``) builds a hook from.

The hooks themselves (``training/comm/``) import torch; the API process must not (it would
load torch into every API worker on the first fine-tune submission). So each hook's options
are declared here, once, as a strict pydantic model (names, types, defaults, ranges, the checks
between options), and its implementation is named by module and attribute, imported only when
a hook is built. A hook's state class takes the validated model: options are checked where they
enter (:func:`validate`) and passed on as that typed object, never checked again. Adding a hook
is its implementation module plus one :data:`HOOKS` entry (and its model, when it has options
of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class CommError(ValueError):
    """A bad hook name or option (``training.comm.CommError`` is this class)."""


class HookOptions(BaseModel):
    """What every hook takes (each hook's model adds ``density`` and its own options)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    fp16: bool = False
    sync_cuda_timing: bool = False


class DenseOptions(HookOptions):
    density: float = Field(1.0, gt=0, le=1)


class SparseOptions(HookOptions):
    """What every sparse hook shares (``training.comm.state.HookState``)."""

    density: float = Field(0.01, gt=0, le=1)
    warmup: int = Field(0, ge=0, le=1_000_000)
    warmup_mode: Literal["exp", "dense"] = "exp"
    momentum: float = Field(0.0, ge=0, lt=1)
    async_comm: bool = False
    cuda_graphs: bool = False
    """Replay each bucket's steady-state step as a CUDA graph (``training/comm/graphs.py``);
    CUDA only (ignored on a CPU), and only for schemes without host-side control."""

    def _no_graphs(self, why: str) -> None:
        if self.cuda_graphs:
            raise ValueError(f"cuda_graphs needs a steady state without host control: {why}")


class TopkOptions(SparseOptions):
    pass


class GaussianKOptions(SparseOptions):
    refine: int = Field(3, ge=0, le=64)


class SparDLOptions(SparseOptions):
    teams: int = Field(1, ge=1, le=4096)
    split: Literal["gap", "halving", "pow2"] = "gap"
    pairs16: Literal["bf16", "fp16"] | None = None

    @model_validator(mode="after")
    def _bf16_pairs_not_fp16(self) -> SparDLOptions:
        if self.pairs16 == "bf16" and self.fp16:
            raise ValueError("pairs16='bf16' sends bfloat16 values; drop fp16=True")
        if self.teams > 1:
            self._no_graphs("teams > 1 adapts its cross-team share on the host")
        return self


class ExDynaOptions(SparseOptions):
    blocks: int = Field(256, ge=1, le=1 << 20)
    max_shift: int = Field(1, ge=0, le=1 << 20)
    controller: Literal["paper", "probes"] = "probes"

    @model_validator(mode="after")
    def _graphs(self) -> ExDynaOptions:
        self._no_graphs("exdyna steers its threshold and partitions on the host")
        return self


class DFSOptions(SparseOptions):
    block_size: int = Field(16, ge=1)
    max_block: int = Field(256, ge=1, le=1 << 20)
    grow_at: float = Field(0.6, gt=0, le=1)
    shrink_at: float = Field(0.3, ge=0, lt=1)

    @model_validator(mode="after")
    def _ordered(self) -> DFSOptions:
        if self.block_size > self.max_block:
            raise ValueError(f"block_size must be in [1, max_block], got {self.block_size}")
        if not self.shrink_at < self.grow_at:
            raise ValueError(f"need shrink_at < grow_at, got {self.shrink_at}, {self.grow_at}")
        self._no_graphs("dfs resizes its blocks on the host")
        return self


@dataclass(frozen=True)
class Hook:
    """One hook: its options model and its implementation, ``zoopick.training.comm.<module>``'s
    ``state`` class (built from a validated ``options`` instance and a process group) and
    ``hook`` function (DDP's ``hook(state, bucket)``), named rather than imported: this module
    stays torch-free."""

    options: type[HookOptions]
    module: str
    state: str
    hook: str


HOOKS: dict[str, Hook] = {
    "dense": Hook(DenseOptions, "dense", "DenseState", "dense_hook"),
    "topk": Hook(TopkOptions, "topk", "TopKState", "topk_hook"),
    "gaussiank": Hook(GaussianKOptions, "gaussiank", "GaussianKState", "gaussiank_hook"),
    "spardl": Hook(SparDLOptions, "spardl", "SparDLState", "spardl_hook"),
    "exdyna": Hook(ExDynaOptions, "exdyna", "ExDynaState", "exdyna_hook"),
    "dfs": Hook(DFSOptions, "dfs", "DFSState", "dfs_hook"),
}
"""Every hook by name: the names the job schema, the dashboard and the CLI offer, and the one
place a hook is declared (``training.comm.registry`` builds its hooks from here)."""


def option_schemas() -> list[dict[str, Any]]:
    """Each hook's options as a JSON schema (``density`` aside: it is a field of its own),
    for the job schema's ``hook_options``: published in the OpenAPI document, one per hook."""
    schemas = []
    for name, hook in HOOKS.items():
        schema = hook.options.model_json_schema()
        schema["properties"].pop("density", None)
        schema["title"] = f"{name} options"
        schema["description"] = f'hook_options when "compressor" is "{name}"'
        schemas.append(schema)
    return schemas


def names() -> list[str]:
    return sorted(HOOKS)


def has_option(name: str, option: str) -> bool:
    return option in options_model(name).model_fields


def options_model(name: str) -> type[HookOptions]:
    try:
        return HOOKS[name].options
    except KeyError:
        raise CommError(f"unknown comm hook {name!r}; available: {', '.join(names())}") from None


def validate(name: str, *, density: float, options: dict[str, Any]) -> HookOptions:
    """``options`` with ``density`` checked for hook ``name``, where they enter (a job's
    submission, a run's config, ``make_hook``'s keywords): the typed options its state class
    takes, defaults filled in. Raises :class:`CommError` naming the bad option."""
    model = options_model(name)
    if "density" in options:  # make_hook's own argument: the options must not say it twice
        raise CommError(f"comm hook {name!r}: density is set on its own, not as an option")
    try:
        return model.model_validate({**options, "density": density})
    except ValidationError as exc:
        raise CommError(f"comm hook {name!r}: {describe(exc, model)}") from None


def stored(name: str, *, density: float, options: dict[str, Any]) -> HookOptions:
    """Options :func:`validate` accepted before (a job's stored ``finetune``, a run's config
    validated when its process read it) as the typed object, without checking them again:
    defaults filled in, an option the model does not know left out."""
    model = options_model(name)
    known = {k: v for k, v in options.items() if k in model.model_fields}
    return model.model_construct(**known, density=density)


def check_world(name: str, options: dict[str, Any], min_workers: int, max_workers: int) -> None:
    """Refuse options that no world size of the run can use: spardl's ``teams`` must divide
    the number of workers, at every count an elastic run (``min``..``max``) may take (the
    hook itself would only fail at its first step, after the job scored every model)."""
    teams = options.get("teams", 1) if name == "spardl" else 1
    if not isinstance(teams, int) or teams <= 1:
        return
    bad = [n for n in range(min_workers, max_workers + 1) if n % teams]
    if bad:
        counts = (
            f"{min_workers}" if min_workers == max_workers else f"{min_workers} to {max_workers}"
        )
        raise CommError(
            f"hook_options.teams: {teams} teams cannot divide {bad[0]} workers (spardl splits "
            f"the workers into equal teams; this run may have {counts} workers)"
        )


def describe(exc: ValidationError, model: type[BaseModel]) -> str:
    """A validation error as one line naming each bad option (and, for an unknown one, the
    options there are)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(set(model.model_fields) - {"density"}))
            parts.append(f"no option(s) {where!r} (its options: {known})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)
