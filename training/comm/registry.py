"""Registry of communication hooks by name, and the ``make_hook`` entry point.

A hook module registers ``(state class, hook function)``; the state class's keyword-only
constructor arguments are the hook's options, declared (types, defaults, ranges) in the
torch-free ``training.comm_options``, so ``make_hook`` rejects an unknown or bad one with a
message naming it instead of failing deep inside a training step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zoopick.training.comm.errors import CommError
from zoopick.training.comm_options import validate

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class HookSpec:
    name: str
    state_cls: type
    hook: Hook
    summary: str

    @property
    def options(self) -> dict[str, Any]:
        """Option name -> default value: the keyword-only parameters of the state class's
        constructor, and of its base's when it passes ``**common`` on to it."""
        out: dict[str, Any] = {}
        for cls in self.state_cls.__mro__:
            init = cls.__dict__.get("__init__")
            if init is None:
                continue
            params = inspect.signature(init).parameters.values()
            for p in params:
                if p.kind is inspect.Parameter.KEYWORD_ONLY:
                    out.setdefault(p.name, p.default)
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                break
        return out


_REGISTRY: dict[str, HookSpec] = {}


def register(name: str, state_cls: type, hook: Hook) -> None:
    """Register ``hook`` under ``name``. Hook modules must not use ``from __future__ import
    annotations``: DDP compares the ``bucket`` annotation with ``dist.GradBucket`` itself."""
    bucket_ann = inspect.signature(hook).parameters["bucket"].annotation
    if bucket_ann not in (inspect.Parameter.empty, dist.GradBucket):
        raise CommError(f"comm hook {name!r}: annotate bucket as dist.GradBucket, not a string")
    if name in _REGISTRY:
        raise CommError(f"comm hook {name!r} registered twice")
    doc = (inspect.getdoc(hook) or "").strip().splitlines()
    _REGISTRY[name] = HookSpec(name, state_cls, hook, doc[0] if doc else "")


def available() -> list[str]:
    """Names of the registered hooks."""
    return sorted(_REGISTRY)


def get(name: str) -> HookSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CommError(
            f"unknown comm hook {name!r}; available: {', '.join(available())}"
        ) from None


def check_options(name: str, *, density: float = 0.01, **options: Any) -> None:
    """Validate a hook's name, density and options without a process group (and without
    torch: ``training.comm_options``). Raises ``CommError``."""
    validate(name, density=density, options=options)


def make_hook(
    name: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    density: float = 0.01,
    **options: Any,
) -> tuple[Any, Hook]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``options`` are the hook's keyword options, checked against its model in
    ``training.comm_options`` (an unknown or bad one raises ``CommError`` naming it)."""
    spec = get(name)
    checked = validate(name, density=density, options=options)
    state = spec.state_cls(process_group, **checked)
    return state, spec.hook
