"""A stand-in for ``dist.GradBucket`` to drive hooks without DDP (tests, benchmarks).

It lays the given parameters' gradients out in one flat buffer exactly like DDP does
(``gradients()`` are views of ``buffer()``), so a hook cannot tell the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SimpleBucket:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None = None,
        *,
        index: int = 0,
        is_last: bool = True,
    ) -> None:
        self._params = list(params)
        numel = sum(p.numel() for p in self._params)
        device = self._params[0].device if self._params else torch.device("cpu")
        self._buffer = torch.zeros(numel, dtype=torch.float32, device=device)
        self._index = index
        self._is_last = is_last
        if grads is not None:
            self.set_gradients(grads)

    def set_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        for view, g in zip(self.gradients(), grads, strict=True):
            view.copy_(g)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """A new view of the buffer per parameter on every call, as DDP's C++ makes them (one
        split, then a view each: benchmarks/comm/host_overhead.py times hooks on these)."""
        sizes = [p.numel() for p in self._params]
        return [
            g.view(p.shape) for g, p in zip(self._buffer.split(sizes), self._params, strict=True)
        ]
