"""The hooks by name, built from their one declaration, and the ``make_hook`` entry point.

Each hook is declared once, in the torch-free ``training.comm_options.HOOKS``: its options
model (names, types, defaults, ranges) and the module, state class and hook function that
implement it. This module imports the implementation when a hook is first asked for, and
builds the state from a validated options model: ``make_hook`` validates its keywords once
(an unknown or bad option raises a message naming it, not a failure deep inside a training
step), :func:`build` takes options validated before.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zoopick.training import comm_options
from zoopick.training.comm.errors import CommError
from zoopick.training.comm_options import HookOptions

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class HookSpec:
    name: str
    model: type[HookOptions]
    state_cls: type
    hook: Hook
    summary: str

    @property
    def options(self) -> dict[str, Any]:
        """Option name -> default value, from the hook's options model."""
        return {k: f.default for k, f in self.model.model_fields.items()}


def available() -> list[str]:
    """Names of the hooks."""
    return comm_options.names()


@functools.cache
def get(name: str) -> HookSpec:
    """The hook ``name`` (its implementation imported on first use). Hook modules must not use
    ``from __future__ import annotations``: DDP compares the ``bucket`` annotation with
    ``dist.GradBucket`` itself."""
    model = comm_options.options_model(name)  # "unknown comm hook 'x'; available: ..."
    decl = comm_options.HOOKS[name]
    module = importlib.import_module(f"zoopick.training.comm.{decl.module}")
    state_cls, hook = getattr(module, decl.state), getattr(module, decl.hook)
    bucket_ann = inspect.signature(hook).parameters["bucket"].annotation
    if bucket_ann not in (inspect.Parameter.empty, dist.GradBucket):
        raise CommError(f"comm hook {name!r}: annotate bucket as dist.GradBucket, not a string")
    doc = (inspect.getdoc(hook) or "").strip().splitlines()
    return HookSpec(name, model, state_cls, hook, doc[0] if doc else "")


def check_options(name: str, *, density: float = 0.01, **options: Any) -> None:
    """Validate a hook's name, density and options without a process group (and without
    torch: ``training.comm_options``). Raises ``CommError``."""
    comm_options.validate(name, density=density, options=options)


def build(
    name: str, options: HookOptions, process_group: dist.ProcessGroup | None = None
) -> tuple[Any, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)`` from ``options``
    validated before (``comm_options.validate``, or a run's config read by its process): they
    are not checked again, only that they are this hook's model."""
    spec = get(name)
    if not isinstance(options, spec.model):
        raise TypeError(f"comm hook {name!r} takes {spec.model.__name__}, not {type(options)}")
    return spec.state_cls(options, process_group), spec.hook


def make_hook(
    name: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    density: float = 0.01,
    **options: Any,
) -> tuple[Any, Hook]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``options`` are the hook's keyword options, validated here against its model in
    ``training.comm_options`` (an unknown or bad one raises ``CommError`` naming it)."""
    return build(name, comm_options.validate(name, density=density, options=options), process_group)
