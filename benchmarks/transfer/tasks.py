"""Source and target tasks for the transfer benchmark, uint8 images of 32x32 pixels (except
the `photo64` target, 64x64, and the sources of the `fonts` and `synth` zoos, drawn at each
model's input size by :mod:`glyphsets`, :mod:`synthetic` and :mod:`photos`).

Every generator is seeded and returns ``(x, y, class_names)``: ``x`` uint8 of shape (N, H, W)
(grey) or (N, H, W, 3) (colour), ``y`` int64 labels in ``0..C-1``. Procedural tasks are drawn
with numpy signed-distance fields (antialiased edges), so they need no download. Sources and
targets are deliberately different tasks (held-out Fashion-MNIST classes, digits never seen in
pretraining, unseen shapes and textures), so which pretraining helps is not obvious from the
names alone and the ranking has something to get right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.transfer import glyphsets, photos, synthetic

SIZE = 32
VERSION = 3  # bump when a generator changes: build_zoo refuses to mix versions in one zoo
Task = tuple[np.ndarray, np.ndarray, list[str]]
Split = tuple[Task, Task]

FMNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
SOURCE_SHAPES = ("circle", "square", "triangle", "line")
TARGET_SHAPES = ("ring", "cross", "ell", "tee", "ellipse", "arc")
TEXTURES = ("checker", "dots", "rings", "zigzag", "hatch", "blobs")
LETTERS = ("A", "E", "F", "H", "K", "N", "R", "X")
COUNTS = ("one", "two", "three", "four", "five")


def per_class(n: int, scale: float, minimum: int = 10) -> int:
    """``n`` images a class at ``scale`` (never fewer than ``minimum``)."""
    return max(minimum, round(n * scale))


def _pad_to_size(x: np.ndarray) -> np.ndarray:
    """Centre 28x28 images on a 32x32 black canvas (no resampling, so no blur)."""
    p = (SIZE - x.shape[1]) // 2
    return np.pad(x, ((0, 0), (p, SIZE - x.shape[1] - p), (p, SIZE - x.shape[2] - p)))


# --------------------------------------------------------------------------------------------
# Fashion-MNIST and scikit-learn digits


def fmnist(
    path: str | Path, classes: Sequence[int], n_per_class: int, *, split: str, seed: int
) -> Task:
    """A seeded class-balanced subset of Fashion-MNIST (Keras npz layout), relabelled 0..C-1."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    with np.load(path) as data:
        x_all, y_all = data[f"x_{split}"], data[f"y_{split}"].astype(np.int64)
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for label, c in enumerate(classes):
        idx = np.flatnonzero(y_all == c)
        if len(idx) < n_per_class:
            raise ValueError(
                f"Fashion-MNIST {split} has {len(idx)} of class {c}, need {n_per_class}"
            )
        pick = np.sort(rng.choice(idx, n_per_class, replace=False))
        xs.append(x_all[pick])
        ys.append(np.full(n_per_class, label, dtype=np.int64))
    return (
        _pad_to_size(np.concatenate(xs)),
        np.concatenate(ys),
        [FMNIST_CLASSES[c] for c in classes],
    )


def digits(n_train_per_class: int, *, seed: int, n_test_per_class: int | None = None) -> Split:
    """scikit-learn's 8x8 digits, upsampled (bilinear) to 24x24 and placed at a random offset on
    a 32x32 canvas; a seeded per-class train/test split (test: the rest, or a capped number)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    rng = np.random.default_rng(seed)
    imgs = np.zeros((len(d.target), SIZE, SIZE), dtype=np.uint8)
    for i, im in enumerate(d.images):
        small = Image.fromarray((im * (255 / 16)).round().astype(np.uint8))
        big = np.asarray(small.resize((24, 24), Image.Resampling.BILINEAR))
        oy, ox = rng.integers(0, SIZE - 24 + 1, size=2)
        imgs[i, oy : oy + 24, ox : ox + 24] = big
    train_idx, test_idx = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(d.target == c))
        if len(idx) <= n_train_per_class:
            raise ValueError(f"digits class {c} has only {len(idx)} images")
        train_idx.append(idx[:n_train_per_class])
        rest = idx[n_train_per_class:]
        test_idx.append(rest if n_test_per_class is None else rest[:n_test_per_class])
    names = [str(c) for c in range(10)]
    tr, te = np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))
    y = d.target.astype(np.int64)
    return (imgs[tr], y[tr], names), (imgs[te], y[te], list(names))


# --------------------------------------------------------------------------------------------
# procedural shapes

_YY, _XX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64) + 0.5


def _box(px: np.ndarray, py: np.ndarray, hx: float, hy: float) -> np.ndarray:
    qx, qy = np.abs(px) - hx, np.abs(py) - hy
    outside = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0))
    return outside + np.minimum(np.maximum(qx, qy), 0)


def _polygon(px: np.ndarray, py: np.ndarray, n: int, r: float) -> np.ndarray:
    """Regular n-gon with circumradius ``r`` (exact inside, a close bound outside)."""
    apothem = r * np.cos(np.pi / n)
    d = np.full(px.shape, -np.inf)
    for k in range(n):
        a = 2 * np.pi * k / n + np.pi / n + np.pi / 2
        d = np.maximum(d, px * np.cos(a) + py * np.sin(a) - apothem)
    return d


def _segment(px: np.ndarray, py: np.ndarray, half: float, width: float) -> np.ndarray:
    """Capsule along x of half-length ``half`` and half-width ``width``."""
    return np.hypot(px - np.clip(px, -half, half), py) - width


def shape_sdf(kind: str, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Signed distance (pixels, negative inside) of a shape of radius ~``r`` centred at
    (cx, cy), rotated by ``angle``."""
    dx, dy = _XX - cx, _YY - cy
    c, s = np.cos(angle), np.sin(angle)
    px, py = c * dx + s * dy, -s * dx + c * dy
    w = max(1.2, 0.18 * r)
    if kind == "circle":
        return np.hypot(px, py) - r
    if kind == "square":
        return _box(px, py, 0.8 * r, 0.8 * r)
    if kind == "triangle":
        return _polygon(px, py, 3, 1.1 * r)
    if kind == "line":
        return _segment(px, py, r, w)
    if kind == "ring":
        return np.abs(np.hypot(px, py) - 0.75 * r) - w
    if kind == "cross":
        return np.minimum(_box(px, py, r, w), _box(px, py, w, r))
    if kind == "ell":
        return np.minimum(_box(px + 0.5 * r, py, w, r), _box(px, py - r + w, 0.5 * r + w, w))
    if kind == "tee":
        return np.minimum(_box(px, py + 0.1 * r, w, 0.9 * r), _box(px, py + r - w, r, w))
    if kind == "ellipse":
        a, b = r, 0.5 * r
        return (np.hypot(px / a, py / b) - 1) * b
    if kind == "arc":
        ring = np.abs(np.hypot(px, py) - 0.75 * r) - w
        return np.maximum(ring, -py)  # keep the half with py >= 0
    raise ValueError(f"unknown shape {kind!r}")


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random (foreground, background) colour pair with the foreground brighter in every
    channel: hue varies freely but the polarity stays fixed (random polarity per channel makes
    the tasks far too hard for a few hundred images)."""
    return rng.uniform(150, 255, size=3), rng.uniform(0, 100, size=3)


def shapes(
    classes: Sequence[str],
    n_per_class: int,
    *,
    seed: int,
    colour: bool = False,
    clutter: int = 0,
    noise: float = 20.0,
) -> Task:
    """One shape a picture at random position, size, rotation and contrast on a noisy
    background; ``clutter`` random short strokes are added as distractors; ``colour`` draws
    random foreground and background colours (else grey)."""
    rng = np.random.default_rng(seed)
    n = len(classes) * n_per_class
    xs = np.empty((n, SIZE, SIZE, 3) if colour else (n, SIZE, SIZE), dtype=np.uint8)
    ys = np.repeat(np.arange(len(classes), dtype=np.int64), n_per_class)
    for i, label in enumerate(ys):
        r = rng.uniform(6, 11)
        cx, cy = rng.uniform(r + 1, SIZE - r - 1, size=2)
        alpha = np.clip(0.5 - shape_sdf(classes[label], cx, cy, r, rng.uniform(0, 2 * np.pi)), 0, 1)
        for _ in range(clutter):
            sx, sy = rng.uniform(0, SIZE, size=2)
            stroke = _segment_at(sx, sy, rng.uniform(1.5, 3.5), rng.uniform(0, np.pi), 0.7)
            alpha = np.maximum(alpha, np.clip(0.5 - stroke, 0, 1) * rng.uniform(0.4, 0.9))
        if colour:
            fg, bg = _colours(rng)
            img = bg + alpha[..., None] * (fg - bg) + rng.normal(0, noise, (SIZE, SIZE, 3))
        else:
            bg, fg = rng.uniform(0, 90), rng.uniform(150, 255)
            img = bg + alpha * (fg - bg) + rng.normal(0, noise, (SIZE, SIZE))
        xs[i] = np.clip(img, 0, 255).round().astype(np.uint8)
    return xs, ys, list(classes)


def _segment_at(cx: float, cy: float, half: float, angle: float, width: float) -> np.ndarray:
    dx, dy = _XX - cx, _YY - cy
    c, s = np.cos(angle), np.sin(angle)
    return _segment(c * dx + s * dy, -s * dx + c * dy, half, width)


# --------------------------------------------------------------------------------------------
# procedural textures


def stripes(
    n_orientations: int, freq_bands: Sequence[tuple[float, float]], n_per_class: int, *, seed: int
) -> Task:
    """Grey sinusoidal gratings; the class is (orientation, spatial-frequency band)."""
    rng = np.random.default_rng(seed)
    names, xs, ys = [], [], []
    label = 0
    for o in range(n_orientations):
        for lo, hi in freq_bands:
            names.append(f"{180 * o // n_orientations}deg-{lo:g}-{hi:g}")
            for _ in range(n_per_class):
                theta = np.pi * o / n_orientations + rng.normal(0, 0.06)
                freq = rng.uniform(lo, hi) * 2 * np.pi
                wave = np.sin(
                    freq * (_XX * np.cos(theta) + _YY * np.sin(theta)) + rng.uniform(0, 7)
                )
                img = 128 + rng.uniform(40, 110) * wave + rng.normal(0, 20, (SIZE, SIZE))
                xs.append(np.clip(img, 0, 255).round().astype(np.uint8))
                ys.append(label)
            label += 1
    return np.stack(xs), np.array(ys, dtype=np.int64), names


def _smooth_noise(rng: np.random.Generator, cells: int) -> np.ndarray:
    """Value noise: a coarse random grid upsampled bilinearly to 32x32."""
    from PIL import Image

    grid = rng.uniform(0, 255, (cells, cells)).astype(np.float32)
    return np.asarray(
        Image.fromarray(grid, mode="F").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    )


def texture_pattern(kind: str, rng: np.random.Generator) -> np.ndarray:
    """A [0, 1] pattern of the given texture kind at a random scale, rotation and phase."""
    theta = rng.uniform(0, np.pi)
    c, s = np.cos(theta), np.sin(theta)
    u = c * _XX + s * _YY + rng.uniform(0, 50)
    v = -s * _XX + c * _YY + rng.uniform(0, 50)
    period = rng.uniform(5, 11)
    if kind == "checker":
        return ((np.floor(u / period) + np.floor(v / period)) % 2).astype(np.float64)
    if kind == "dots":
        fu, fv = (u / period) % 1 - 0.5, (v / period) % 1 - 0.5
        return np.clip(0.5 - (np.hypot(fu, fv) - 0.25) * period, 0, 1)
    if kind == "rings":
        cx, cy = rng.uniform(0, SIZE, size=2)
        return 0.5 + 0.5 * np.sin(2 * np.pi * np.hypot(_XX - cx, _YY - cy) / period)
    if kind == "zigzag":
        tri = np.abs((v / period) % 2 - 1) * period * 0.8
        return 0.5 + 0.5 * np.sin(2 * np.pi * (u + tri) / period)
    if kind == "hatch":
        a = 0.5 + 0.5 * np.sin(2 * np.pi * u / period)
        b = 0.5 + 0.5 * np.sin(2 * np.pi * v / period)
        return np.maximum(a, b) ** 2
    if kind == "blobs":
        noise = _smooth_noise(rng, int(rng.integers(4, 7)))
        return (noise > np.median(noise)).astype(np.float64)
    raise ValueError(f"unknown texture {kind!r}")


def textures(classes: Sequence[str], n_per_class: int, *, seed: int, noise: float = 25.0) -> Task:
    """Colour textures (two random colours, random contrast, pixel noise); class = pattern."""
    rng = np.random.default_rng(seed)
    n = len(classes) * n_per_class
    xs = np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(len(classes), dtype=np.int64), n_per_class)
    for i, label in enumerate(ys):
        pat = texture_pattern(classes[label], rng)
        fg, bg = _colours(rng)
        img = bg + pat[..., None] * (fg - bg) + rng.normal(0, noise, (SIZE, SIZE, 3))
        xs[i] = np.clip(img, 0, 255).round().astype(np.uint8)
    return xs, ys, list(classes)


def counts(classes: Sequence[str], n_per_class: int, *, seed: int, noise: float = 25.0) -> Task:
    """1..len(classes) small shapes of random kinds (the target shapes) on a colour picture; the
    class is how many there are. Counting is a global property that no source task trains;
    centres are rejection-sampled so shapes never touch (the count stays visible)."""
    rng = np.random.default_rng(seed)
    n = len(classes) * n_per_class
    xs = np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(len(classes), dtype=np.int64), n_per_class)
    for i, label in enumerate(ys):
        alpha = np.zeros((SIZE, SIZE))
        placed: list[tuple[float, float, float]] = []
        while len(placed) < label + 1:
            r = rng.uniform(2.5, 4.5)
            cx, cy = rng.uniform(r + 1, SIZE - r - 1, size=2)
            if any(np.hypot(cx - x, cy - y) < r + q + 1.5 for x, y, q in placed):
                continue
            placed.append((cx, cy, r))
            kind = TARGET_SHAPES[rng.integers(len(TARGET_SHAPES))]
            sdf = shape_sdf(kind, cx, cy, r, rng.uniform(0, 2 * np.pi))
            alpha = np.maximum(alpha, np.clip(0.5 - sdf, 0, 1))
        fg, bg = _colours(rng)
        img = bg + alpha[..., None] * (fg - bg) + rng.normal(0, noise, (SIZE, SIZE, 3))
        xs[i] = np.clip(img, 0, 255).round().astype(np.uint8)
    return xs, ys, list(classes)


def letters(classes: Sequence[str], n_per_class: int, *, seed: int, noise: float = 25.0) -> Task:
    """Capital letters in Pillow's built-in scalable font at random size, position and rotation
    (+-30 degrees), grey on a noisy background: glyph shapes none of the sources draw."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    n = len(classes) * n_per_class
    xs = np.empty((n, SIZE, SIZE), dtype=np.uint8)
    ys = np.repeat(np.arange(len(classes), dtype=np.int64), n_per_class)
    fonts: dict[int, ImageFont.FreeTypeFont] = {}
    for i, label in enumerate(ys):
        size = int(rng.integers(14, 25))
        font = fonts.setdefault(size, ImageFont.load_default(size=size))
        canvas = Image.new("L", (2 * SIZE, 2 * SIZE))
        ImageDraw.Draw(canvas).text((SIZE, SIZE), classes[label], fill=255, font=font, anchor="mm")
        canvas = canvas.rotate(rng.uniform(-30, 30), resample=Image.Resampling.BILINEAR)
        dx, dy = rng.integers(-6, 7, size=2)
        box = (SIZE // 2 + dx, SIZE // 2 + dy, SIZE // 2 + dx + SIZE, SIZE // 2 + dy + SIZE)
        alpha = np.asarray(canvas.crop(box), dtype=np.float64) / 255.0
        bg, fg = rng.uniform(0, 90), rng.uniform(150, 255)
        img = bg + alpha * (fg - bg) + rng.normal(0, noise, (SIZE, SIZE))
        xs[i] = np.clip(img, 0, 255).round().astype(np.uint8)
    return xs, ys, list(classes)


# --------------------------------------------------------------------------------------------
# the benchmark's named sources and targets

FMNIST_SOURCE_CLASSES = (0, 1, 2, 3, 4, 5)
FMNIST_TARGET_CLASSES = (6, 7, 8, 9)


def _fmnist_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return fmnist(path, FMNIST_SOURCE_CLASSES, per_class(600, scale), split="train", seed=101)


def _shapes_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return shapes(SOURCE_SHAPES, per_class(500, scale), seed=102)


def _stripes_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return stripes(4, [(0.05, 0.12), (0.18, 0.3)], per_class(250, scale), seed=103)


def _stripes100_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    """100 classes: 10 orientations x 10 narrow frequency bands (a many-class head)."""
    bands = [(0.04 + 0.03 * k, 0.065 + 0.03 * k) for k in range(10)]
    return stripes(10, bands, per_class(40, scale), seed=104)


def _fmnist1000_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    """1,000 fine-grained classes: k-means clusters (on pixels) of Fashion-MNIST classes 0-5,
    1,500 images a class, so a model gets an ImageNet-1k-sized head trained on a real task.
    Seeded k-means (sklearn, one init), relabelled by cluster; empty clusters cannot occur
    (k-means keeps every centre on at least one point)."""
    from sklearn.cluster import KMeans

    x, _, _ = fmnist(path, FMNIST_SOURCE_CLASSES, per_class(1500, scale), split="train", seed=105)
    k = min(1000, len(x) // 4)
    flat = x.reshape(len(x), -1).astype(np.float32) / 255.0
    km = KMeans(n_clusters=k, n_init=1, max_iter=30, random_state=0).fit(flat)
    _, y = np.unique(km.labels_, return_inverse=True)
    return x, y.astype(np.int64), [f"cluster{i}" for i in range(int(y.max()) + 1)]


def _latin52_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return glyphsets.latin52(per_class(120, scale), size=size, seed=111)


def _fontdigits10_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return glyphsets.digits10(per_class(200, scale), size=size, seed=112)


def _unicode1000_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return glyphsets.unicode1000(per_class(10, scale, minimum=2), size=size, seed=113)


def _face2_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return glyphsets.face2(per_class(1000, scale), size=size, seed=114)


def _fractal1000_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return synthetic.fractals(1000, per_class(8, scale, minimum=2), size=size, seed=121)


def _fractal100_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return synthetic.fractals(100, per_class(30, scale), size=size, seed=122)


def _leaves16_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return synthetic.dead_leaves(per_class(150, scale), size=size, seed=123)


def _spectra12_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return synthetic.spectra(per_class(200, scale), size=size, seed=124)


def _rotations4_source(path: str | Path, scale: float, size: int = SIZE) -> Task:
    return photos.rotations(per_class(500, scale), size=size, seed=125)


# name -> (generator(fmnist path, scale, size), description). The base zoo's sources draw
# 32-pixel images only; the others draw at the size they are asked for.
SOURCES: dict[str, tuple[Callable[..., Task], str]] = {
    "fmnist6": (
        _fmnist_source,
        "Fashion-MNIST classes 0-5 (tops, trousers, dresses, coats, sandals)",
    ),
    "shapes4": (_shapes_source, "grey procedural shapes: circle, square, triangle, line"),
    "stripes8": (_stripes_source, "grey sinusoidal gratings, 4 orientations x 2 frequency bands"),
    "stripes100": (_stripes100_source, "grey gratings, 10 orientations x 10 frequency bands"),
    "fmnist1000": (
        _fmnist1000_source,
        "1,000 pixel k-means clusters of Fashion-MNIST classes 0-5 (a fine-grained 1k head)",
    ),
    # the fonts zoo: glyphs in matplotlib's DejaVu faces
    "latin52": (_latin52_source, "52 Latin letters (A-Z, a-z) in 10 DejaVu faces"),
    "fontdigits10": (_fontdigits10_source, "the 10 digits in 10 DejaVu faces"),
    "unicode1000": (
        _unicode1000_source,
        "1,000 non-Latin characters (Greek, Cyrillic, symbols) in 4 DejaVu Sans faces",
    ),
    "face2": (_face2_source, "sans or serif (2 classes) over random letters and digits"),
    # the synth zoo: natural-image-like synthetic images, and a natural photo's rotations
    "fractal1000": (_fractal1000_source, "1,000 FractalDB-style IFS classes, colour"),
    "fractal100": (_fractal100_source, "100 FractalDB-style IFS classes, colour"),
    "leaves16": (_leaves16_source, "dead leaves: 4 leaf shapes x 4 size exponents"),
    "spectra12": (_spectra12_source, "1/f^alpha colour noise: 4 exponents x 3 anisotropies"),
    "rotations4": (
        _rotations4_source,
        "RotNet pretext: patches of matplotlib's Grace Hopper photo rotated 0/90/180/270",
    ),
}
SOURCE_CLASSES = {
    "fmnist6": 6,
    "shapes4": 4,
    "stripes8": 8,
    "stripes100": 100,
    "fmnist1000": 1000,
    "latin52": 52,
    "fontdigits10": 10,
    "unicode1000": 1000,
    "face2": 2,
    "fractal1000": 1000,
    "fractal100": 100,
    "leaves16": 16,
    "spectra12": 12,
    "rotations4": 4,
}
"""Head size of each source at full scale (the built checkpoint's is recorded in build.json,
and wins: fmnist1000 has fewer clusters below --scale 0.67)."""


def _fmnist_target(path: str | Path, scale: float) -> Split:
    train = fmnist(path, FMNIST_TARGET_CLASSES, per_class(60, scale), split="train", seed=201)
    test = fmnist(path, FMNIST_TARGET_CLASSES, per_class(250, scale), split="test", seed=202)
    return train, test


def _digits_target(path: str | Path, scale: float) -> Split:
    return digits(per_class(40, scale), seed=203, n_test_per_class=per_class(120, scale))


def _glyphs_target(path: str | Path, scale: float) -> Split:
    kw = {"colour": True, "clutter": 3, "noise": 30.0}
    return (
        shapes(TARGET_SHAPES, per_class(50, scale), seed=204, **kw),
        shapes(TARGET_SHAPES, per_class(150, scale), seed=205, **kw),
    )


def _textures_target(path: str | Path, scale: float) -> Split:
    return (
        textures(TEXTURES, per_class(50, scale), seed=206, noise=50.0),
        textures(TEXTURES, per_class(150, scale), seed=207, noise=50.0),
    )


def _letters_target(path: str | Path, scale: float) -> Split:
    return (
        letters(LETTERS, per_class(40, scale), seed=208),
        letters(LETTERS, per_class(120, scale), seed=209),
    )


def _counts_target(path: str | Path, scale: float) -> Split:
    return (
        counts(COUNTS, per_class(60, scale), seed=210),
        counts(COUNTS, per_class(150, scale), seed=211),
    )


def _chars62_target(path: str | Path, scale: float) -> Split:
    return (
        glyphsets.chars62(per_class(10, scale, minimum=10), size=SIZE, seed=212),
        glyphsets.chars62(per_class(20, scale, minimum=10), size=SIZE, seed=213),
    )


def _photo64_target(path: str | Path, scale: float) -> Split:
    return (
        photos.regions(per_class(40, scale), size=64, seed=214, half="left"),
        photos.regions(per_class(100, scale), size=64, seed=215, half="right"),
    )


SHIRTS = (0, 6)  # T-shirt/top (a base-zoo source class) and Shirt (never in pretraining)


def _shirts2_target(path: str | Path, scale: float) -> Split:
    train = fmnist(path, SHIRTS, per_class(300, scale), split="train", seed=216)
    test = fmnist(path, SHIRTS, per_class(500, scale), split="test", seed=217)
    return train, test


TARGETS: dict[str, tuple[Callable[[str | Path, float], Split], str]] = {
    "fmnist4": (_fmnist_target, "Fashion-MNIST classes 6-9 (shirt, sneaker, bag, ankle boot)"),
    "digits": (_digits_target, "scikit-learn 8x8 digits upsampled, random offset"),
    "glyphs": (_glyphs_target, "colour shapes unseen in pretraining, with clutter strokes"),
    "textures": (_textures_target, "colour textures: checker, dots, rings, zigzag, hatch, blobs"),
    "letters": (_letters_target, "grey capital letters in Pillow's font, rotated, noisy"),
    "counts": (_counts_target, "colour pictures of 1 to 5 small shapes: how many?"),
    # issue 20: a 62-class few-shot set, 64-pixel natural RGB patches, a data-rich 2-class set
    "chars62": (
        _chars62_target,
        "62 characters (0-9, A-Z, a-z) in fonts no zoo saw (Computer Modern, STIX, Pillow's), "
        "10 a class",
    ),
    "photo64": (
        _photo64_target,
        "64-px RGB patches of scikit-learn's two sample photos: sky, water, roof, trees, "
        "petals, leaves",
    ),
    "shirts2": (_shirts2_target, "Fashion-MNIST T-shirt/top vs Shirt, 300 a class"),
}
