"""Train-time augmentation on batches already on the device.

Why on the batch and not in a data loader: the trainer decodes a dataset once into uint8
tensors at the model's eval resolution (``selection.extract.preprocess``), so a transform of
the batch is the only place left, and it costs a gather instead of a PIL round trip per image.

One transform, chosen to be safe on every kind of image a user may bring (photos, digits,
text, textures, counts): a random shift of up to 1/8 of the side in each direction, the edge
pixels replicated into the gap. No flips (a mirrored letter is another glyph), no colour
changes (colour can be the class), no crops that could cut the object out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHIFT_SHARE = 8
"""The largest shift is 1/SHIFT_SHARE of the side (at least one pixel)."""


def shift(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (N, C, H, W, float) with each image moved by its own random offset of up to
    ``max(1, side // SHIFT_SHARE)`` pixels along each axis (replicated edges); offsets are
    drawn from ``generator`` (on the CPU), so a seeded run repeats."""
    n, _, h, w = x.shape
    ph, pw = max(1, h // SHIFT_SHARE), max(1, w // SHIFT_SHARE)
    padded = F.pad(x, (pw, pw, ph, ph), mode="replicate")
    dy = torch.randint(0, 2 * ph + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * pw + 1, (n,), generator=generator).to(x.device)
    rows = dy[:, None] + torch.arange(h, device=x.device)  # (N, H)
    cols = dx[:, None] + torch.arange(w, device=x.device)  # (N, W)
    batch = torch.arange(n, device=x.device)[:, None, None]
    # advanced indices split by the channel slice: the result is (N, H, W, C)
    out = padded[batch, :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()
