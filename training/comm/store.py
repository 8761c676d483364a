"""Per-parameter state (error-feedback residuals, momentum) that survives bucket rebuilds.

DDP rebuilds its buckets after the first iteration, so a bucket index does not name the same
gradients over time. The store therefore keys everything by the parameter object and slices a
bucket's flat buffer with the offset of each parameter's gradient inside it
(``bucket.gradients()`` are views of ``bucket.buffer()``). A parameter seen for the first time
starts from zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BucketLayout:
    """Where each parameter's gradient lies in a bucket's flat buffer."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    numel: int

    @property
    def key(self) -> tuple[int, ...]:
        """Identity of the bucket's content (stable across iterations, changes on rebuild)."""
        return tuple(id(p) for p in self.params) + (self.numel,)

    @classmethod
    def of(cls, bucket) -> BucketLayout:
        buf = bucket.buffer()
        params = tuple(bucket.parameters())
        grads = list(bucket.gradients())
        if len(grads) != len(params):
            raise ValueError(f"bucket has {len(params)} parameters but {len(grads)} gradients")
        offsets: list[int] = []
        lengths: list[int] = []
        running = 0
        base = buf.untyped_storage().data_ptr()
        for g in grads:
            if g.numel() and g.untyped_storage().data_ptr() == base:
                off = (g.data_ptr() - buf.data_ptr()) // buf.element_size()
            else:  # not a view of the buffer: DDP's layout is consecutive in parameter order
                off = running
            offsets.append(int(off))
            lengths.append(int(g.numel()))
            running = off + g.numel()
        for off, length in zip(offsets, lengths, strict=True):
            if off < 0 or off + length > buf.numel():
                raise ValueError("gradient view lies outside the bucket buffer")
        return cls(params, tuple(offsets), tuple(lengths), int(buf.numel()))


class ParamStore:
    """A flat float32 tensor per parameter, read and written bucket-wise."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # bucket key -> the flat tensor whose views were stored by the last ``scatter``
        self._flat: dict[tuple[int, ...], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._data)

    def get(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._data.get(id(param))
        return None if entry is None else entry[1]

    def clear(self) -> None:
        self._data.clear()
        self._flat.clear()

    def named(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """Stored values keyed by parameter name (``names`` maps ``id(param)`` to its name),
        for checkpoints: parameter identities do not survive a restart, names do."""
        return {names[key]: t.detach().cpu().clone() for key, (_, t) in self._data.items()}

    def load_named(self, params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`named` for the parameters of a rebuilt model."""
        unknown = set(values) - set(params)
        if unknown:
            raise KeyError(f"stored values for unknown parameters: {sorted(unknown)[:5]}")
        self._data = {
            id(params[n]): (params[n], v.to(params[n].device, torch.float32).flatten())
            for n, v in values.items()
        }
        self._flat.clear()

    def gather(self, layout: BucketLayout, device: torch.device) -> torch.Tensor:
        """The bucket-shaped flat vector of stored values (zeros where nothing is stored).

        When every parameter's stored values are still the views the last ``scatter`` of this
        same bucket layout made, that flat tensor itself is returned (no allocation, no copy:
        a persistent flat residual per bucket); the caller may update it in place and must
        ``scatter`` the result. Otherwise a fresh vector is assembled."""
        flat = self._flat.get(layout.key)
        if flat is not None and flat.device == device and self._still_views(layout, flat):
            return flat
        out = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True):
            entry = self._data.get(id(p))
            if entry is not None:
                out[off : off + length] = entry[1]
        return out

    def scatter(self, layout: BucketLayout, flat: torch.Tensor) -> None:
        """Store each parameter's slice of ``flat`` (views: the caller must not reuse ``flat``
        for anything else; the next ``gather`` of this layout hands it back)."""
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True):
            self._data[id(p)] = (p, flat[off : off + length])
        if flat.numel() == layout.numel and flat.is_contiguous():
            self._flat[layout.key] = flat

    def _still_views(self, layout: BucketLayout, flat: torch.Tensor) -> bool:
        base = flat.data_ptr()
        size = flat.element_size()
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True):
            entry = self._data.get(id(p))
            if entry is None or entry[1].numel() != length:
                return False
            if entry[1].data_ptr() != base + off * size:
                return False
        return True

    def total(self) -> torch.Tensor | None:
        """All stored values concatenated in insertion order (for inspection and tests)."""
        if not self._data:
            return None
        return torch.cat([t for _, t in self._data.values()])
