"""Natural photographs that installed packages bundle, cut into patches (nothing downloaded):

* ``rotations``: a source. Patches of matplotlib's sample portrait of Grace Hopper rotated by
  0, 90, 180 or 270 degrees; the class is the rotation (RotNet's pretext task, Gidaris et al.,
  ICLR 2018: learning it needs natural-image features, no labels);
* ``regions``: a target (``photo64``). Patches of scikit-learn's two sample photos (a pagoda
  over a lake; a dahlia), 6 classes by what the patch shows: sky, water, roof (the pagoda),
  trees, petals, leaves (the dahlia's blurred background). Training patches come from the left
  half of each region's box and test patches from the right half, so no test pixel was seen
  in training. Half the patches lose their colour and every patch is tinted by a random
  per-channel gain, so hue alone does not decide the class.

Each returns ``(x, y, class_names)`` with ``x`` uint8 (N, size, size, 3).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

Task = tuple[np.ndarray, np.ndarray, list[str]]

# (photo, x0, y0, x1, y1) boxes on the 640x427 pictures; a class may have several boxes
REGIONS: dict[str, tuple[tuple[str, int, int, int, int], ...]] = {
    "sky": (("china", 380, 5, 635, 150),),
    "water": (("china", 360, 238, 545, 300),),
    "roof": (("china", 110, 140, 300, 320),),
    "trees": (
        ("china", 0, 340, 190, 427),
        ("china", 380, 330, 640, 427),
        ("china", 560, 150, 640, 330),
    ),
    "petals": (("flower", 200, 110, 420, 330),),
    "leaves": (("flower", 0, 0, 150, 420), ("flower", 470, 0, 640, 300)),
}


@lru_cache(maxsize=2)
def _sklearn_photos() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_sample_images

    data = load_sample_images()
    names = [Path(f).stem for f in data.filenames]
    return dict(zip(names, data.images, strict=True))


@lru_cache(maxsize=1)
def _hopper() -> np.ndarray:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            'the rotation source cuts matplotlib\'s sample photo: pip install -e ".[bench]"'
        ) from exc
    from PIL import Image

    path = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg"
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _crop(photo: np.ndarray, x0: int, y0: int, side: int, size: int, flip: bool) -> np.ndarray:
    from PIL import Image

    patch = Image.fromarray(photo[y0 : y0 + side, x0 : x0 + side])
    if flip:
        patch = patch.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(patch.resize((size, size), Image.Resampling.BILINEAR), dtype=np.float64)


def _jitter(
    img: np.ndarray, rng: np.random.Generator, strength: float, grey: float = 0.0
) -> np.ndarray:
    """Per-channel gain, brightness and pixel noise; with probability ``grey`` the colour is
    dropped first (luminance in all three channels)."""
    if rng.random() < grey:
        img = np.repeat(img @ np.array([0.299, 0.587, 0.114])[:, None], 3, axis=-1)
    gain = rng.uniform(1 - strength, 1 + strength, size=3)
    img = img * gain + rng.uniform(-25, 25) + rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).round().astype(np.uint8)


def rotations(n_per_class: int, *, size: int, seed: int) -> Task:
    """4 classes (0, 90, 180, 270 degrees) of square patches of the portrait, 96-320 px on
    a side before resizing, mirrored at random."""
    photo = _hopper()
    h, w, _ = photo.shape
    rng = np.random.default_rng(seed)
    names = ["rot0", "rot90", "rot180", "rot270"]
    xs = np.empty((4 * n_per_class, size, size, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(4, dtype=np.int64), n_per_class)
    for i, label in enumerate(ys):
        side = int(rng.integers(96, min(h, w, 320) + 1))
        x0, y0 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        patch = _crop(photo, x0, y0, side, size, bool(rng.random() < 0.5))
        xs[i] = _jitter(np.rot90(patch, k=int(label)), rng, 0.15)
    return xs, ys, names


def regions(n_per_class: int, *, size: int, seed: int, half: str) -> Task:
    """The ``photo64`` target's patches from the ``half`` ("left": training, "right": test)
    of every region box; square crops of 28-96 px (never beyond the half box) resized to
    ``size``, mirrored at random, half of them greyed, then a +-30 % gain per channel."""
    if half not in ("left", "right"):
        raise ValueError(f"half must be 'left' or 'right', got {half!r}")
    photos = _sklearn_photos()
    rng = np.random.default_rng(seed)
    names = list(REGIONS)
    xs = np.empty((len(names) * n_per_class, size, size, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(len(names), dtype=np.int64), n_per_class)
    for i, label in enumerate(ys):
        boxes = REGIONS[names[label]]
        areas = np.array([(x1 - x0) * (y1 - y0) for _, x0, y0, x1, y1 in boxes], dtype=float)
        photo, x0, y0, x1, y1 = boxes[rng.choice(len(boxes), p=areas / areas.sum())]
        mid = (x0 + x1) // 2
        x0, x1 = (x0, mid) if half == "left" else (mid, x1)
        top = min(x1 - x0, y1 - y0, 96)
        side = int(rng.integers(min(28, top), top + 1))
        cx, cy = int(rng.integers(x0, x1 - side + 1)), int(rng.integers(y0, y1 - side + 1))
        patch = _crop(photos[photo], cx, cy, side, size, bool(rng.random() < 0.5))
        xs[i] = _jitter(patch, rng, 0.3, grey=0.5)
    return xs, ys, names
