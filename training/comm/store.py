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
    """Where each parameter's gradient lies in a bucket's flat buffer. ``key`` names the
    bucket's content (parameter ids + numel): stable across iterations, changed by a rebuild."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    numel: int
    key: tuple[int, ...]

    @classmethod
    def of(cls, bucket, cache: dict[tuple[int, ...], BucketLayout] | None = None) -> BucketLayout:
        """The layout of ``bucket``. With ``cache`` (a dict its caller keeps), a bucket seen
        before (same parameters, same buffer address and size) gets the layout found then:
        finding it reads ``bucket.gradients()``, a new view per parameter, and a Python loop
        over them, which on a GPU host cost more than the hook's kernels (issue 19:
        ``benchmarks/results/comm_gpu_host.md``). A rebuilt bucket has a new buffer or other
        parameters, so it misses; were a new buffer to reuse a freed one's address with the
        same parameters in the same order, its layout (consecutive, in parameter order) is
        the same one."""
        buf = bucket.buffer()
        params = tuple(bucket.parameters())
        ident = (*map(id, params), buf.data_ptr(), buf.numel())
        if cache is not None:
            hit = cache.get(ident)
            if hit is not None:
                return hit
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
        numel = int(buf.numel())
        layout = cls(params, tuple(offsets), tuple(lengths), numel, (*map(id, params), numel))
        if cache is not None:
            if len(cache) >= 1024:  # rebuilds only add entries: keep it bounded
                cache.clear()
            cache[ident] = layout
        return layout


class ParamStore:
    """A flat float32 tensor per parameter, read and written bucket-wise."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # bucket key -> the flat tensor whose views the last ``scatter`` of that layout stored,
        # while every one of them is still what is stored (``_owner`` keeps that true)
        self._flat: dict[tuple[int, ...], torch.Tensor] = {}
        # id(param) -> the bucket key whose flat tensor its stored value is a view of
        self._owner: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def get(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._data.get(id(param))
        return None if entry is None else entry[1]

    def clear(self) -> None:
        self._data.clear()
        self._flat.clear()
        self._owner.clear()

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
        self._owner.clear()

    def gather(self, layout: BucketLayout, device: torch.device) -> torch.Tensor:
        """The bucket-shaped flat vector of stored values (zeros where nothing is stored).

        When every parameter's stored values are still the views the last ``scatter`` of this
        same bucket layout made, that flat tensor itself is returned (no allocation, no copy,
        no per-parameter work: a persistent flat residual per bucket); the caller may update
        it in place and must ``scatter`` the result. Otherwise a fresh vector is assembled."""
        flat = self._flat.get(layout.key)
        if flat is not None and flat.device == device:
            return flat
        out = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True):
            entry = self._data.get(id(p))
            if entry is not None:
                out[off : off + length] = entry[1]
        return out

    def flat(self, layout: BucketLayout) -> torch.Tensor | None:
        """The persistent flat tensor that ``gather`` would hand back for ``layout``, or None
        when it would assemble a fresh one (CUDA graphs check it before a replay)."""
        return self._flat.get(layout.key)

    def scatter(self, layout: BucketLayout, flat: torch.Tensor) -> None:
        """Store each parameter's slice of ``flat`` (views: the caller must not reuse ``flat``
        for anything else; the next ``gather`` of this layout hands it back). Scattering the
        flat tensor that ``gather`` handed back costs nothing: its views are already stored."""
        if self._flat.get(layout.key) is flat:
            return
        for p, off, length in zip(layout.params, layout.offsets, layout.lengths, strict=True):
            owner = self._owner.get(id(p))
            if owner is not None and owner != layout.key:  # a rebuilt bucket took it over
                self._flat.pop(owner, None)
            self._owner[id(p)] = layout.key
            self._data[id(p)] = (p, flat[off : off + length])
        if flat.numel() == layout.numel and flat.is_contiguous():
            self._flat[layout.key] = flat
        else:
            self._flat.pop(layout.key, None)

    def total(self) -> torch.Tensor | None:
        """All stored values concatenated in insertion order (for inspection and tests)."""
        if not self._data:
            return None
        return torch.cat([t for _, t in self._data.values()])
