"""A guard that records host reads of tensor values, for the hooks' no-sync tests.

On a CPU nothing is a device sync, so the guard flags what *would* be one on an
accelerator, by intercepting the ops themselves (in this process and thread only):

* at the dispatcher (``TorchDispatchMode``): ``aten._local_scalar_dense`` (what
  ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)`` and ``if t:`` all call), ops whose
  output size depends on the data (``nonzero``, ``unique`` and friends, ``masked_select``,
  ``bincount``, ``repeat_interleave`` by a tensor) and indexing with a boolean mask
  (``x[mask]``, ``x[mask] = v``, which run ``nonzero`` inside);
* at the Python level (``TorchFunctionMode``): ``Tensor.tolist`` and ``Tensor.numpy``,
  which read memory without any dispatcher op, and ``torch.tensor`` / ``as_tensor`` /
  ``new_tensor`` (a tensor from host data: on an accelerator a copy from pageable memory
  that torch follows with a stream synchronisation), and ``x[index_tensor] = scalar`` (the
  scalar is copied to the device the same way: found on a GPU). Python scalars as op
  arguments (``x * 0.5``, ``torch.full``, ``index_fill_``) are kernel arguments, not copies,
  and pass.

Reads inside ``zoopick.training.comm.hostread.sanctioned()`` (deferred values) pass. What
it cannot see on a CPU: a ``.cpu()`` / ``.to("cpu")`` of a tensor that is already on the
CPU (a no-op here, a copy there); the hooks have none (checked by grep in the test).
Violations are recorded, not raised: raising inside one rank's hook would leave the others
waiting in a collective.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from zoopick.training.comm import hostread

aten = torch.ops.aten
SIZE_FROM_DATA = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_numpy,
    aten.argwhere,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.masked_select,
    aten.bincount,
    aten.is_nonzero,
    aten.equal,
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
PY_READS = {torch.Tensor.tolist, torch.Tensor.numpy}
# a tensor built from host data: on an accelerator a copy from pageable memory, after which
# torch synchronises the stream (``torch.tensor(..., device="cuda")``)
FROM_HOST = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/training/comm/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:4])


def _mask_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
        for t in (indices or ())
    )


def _by_tensor(args: tuple, kwargs: dict | None) -> bool:
    """``repeat_interleave`` by a tensor of repeats and without ``output_size``."""
    repeats = args[1] if len(args) > 1 else None
    return isinstance(repeats, torch.Tensor) and not (kwargs or {}).get("output_size")


class _Dispatch(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if not hostread.reading():
            if packet in SIZE_FROM_DATA:
                self.found.append(f"{packet.__name__} at {_where()}")
            elif packet in INDEXING and _mask_index(args):
                self.found.append(f"{packet.__name__} with a boolean mask at {_where()}")
            elif packet is aten.repeat_interleave and _by_tensor(args, kwargs):
                self.found.append(f"repeat_interleave at {_where()}")
        return func(*args, **(kwargs or {}))


def _scalar_into_index(args: tuple) -> bool:
    """``x[t] = 1.0`` with a tensor ``t`` in the key: torch copies the scalar to the device as
    a one-element tensor from pageable memory, a synchronising copy (seen on an H100 under
    ``set_sync_debug_mode``). ``index_fill_`` takes the scalar as a kernel argument instead.
    A slice key (``x[a:b] = 0.0``) is a ``fill_`` of a view and passes."""
    if len(args) < 3 or isinstance(args[2], torch.Tensor):
        return False
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(k, torch.Tensor) for k in key)


class _Function(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in PY_READS and not hostread.reading():
            self.found.append(f"{func.__name__} at {_where()}")
        elif func in FROM_HOST:
            self.found.append(f"{func.__name__} (from host data) at {_where()}")
        elif func is torch.Tensor.__setitem__ and _scalar_into_index(args):
            self.found.append(f"x[index tensor] = scalar at {_where()}")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[list[str]]:
    """Record (in the yielded list) every host read of a tensor value inside the block."""
    found: list[str] = []
    with _Function(found), _Dispatch(found):
        yield found
