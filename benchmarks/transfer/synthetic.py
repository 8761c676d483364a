"""Natural-image-like synthetic sources for the `synth` zoo, drawn at any size with numpy and
Pillow (seeded, nothing downloaded):

* ``fractals``: FractalDB-style classes (Kataoka et al., ACCV 2020): each class is one random
  iterated function system (2-4 contractive affine maps), each image its attractor drawn by
  the chaos game with the maps' parameters jittered by +-10 %, at a random rotation, flip and
  colour;
* ``dead_leaves``: the dead-leaves model of occluding random shapes, whose power-law sizes
  give natural images' scale invariance (Baradad et al., NeurIPS 2021, pretrain on it); a
  class is the leaf shape x the size exponent;
* ``spectra``: coloured noise with a 1/f^alpha amplitude spectrum (natural images have alpha
  near 1-2), isotropic or stretched along an orientation; a class is alpha x the anisotropy.

Each returns ``(x, y, class_names)`` with ``x`` uint8 (N, size, size, 3).
"""

from __future__ import annotations

import numpy as np

Task = tuple[np.ndarray, np.ndarray, list[str]]


def _contractive_maps(rng: np.random.Generator, k: int) -> np.ndarray:
    """``k`` affine maps (k, 2, 3) whose linear parts have largest singular value < 0.9."""
    maps = np.empty((k, 2, 3))
    for j in range(k):
        while True:
            m = rng.uniform(-1, 1, size=(2, 3))
            if np.linalg.svd(m[:, :2], compute_uv=False)[0] < 0.9:
                maps[j] = m
                break
    return maps


def _chaos_game(maps: np.ndarray, rng: np.random.Generator, points: int) -> np.ndarray:
    """Points of the attractor: ``points`` parallel chains, 24 steps each (the first 12
    discarded), each step applying a map chosen with probability proportional to its
    determinant (as FractalDB does), so thin maps do not dominate."""
    det = np.abs(np.linalg.det(maps[:, :, :2])) + 1e-3
    p = det / det.sum()
    xy = rng.uniform(-1, 1, size=(points, 2))
    out = []
    for step in range(24):
        k = rng.choice(len(maps), size=points, p=p)
        a = maps[k]
        xy = np.einsum("nij,nj->ni", a[:, :, :2], xy) + a[:, :, 2]
        if step >= 12:
            out.append(xy)
    return np.concatenate(out)


def _draw_points(xy: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray | None:
    """A [0, 1] density image of the points, fitted into the canvas at a random scale and
    rotation; None when the attractor is degenerate (a point or a line)."""
    theta = rng.uniform(0, 2 * np.pi)
    rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    xy = xy @ rot.T
    if rng.random() < 0.5:
        xy[:, 0] = -xy[:, 0]
    lo, hi = np.percentile(xy, 1, axis=0), np.percentile(xy, 99, axis=0)
    span = float((hi - lo).max())
    if not np.isfinite(span) or span < 1e-6:
        return None
    fill = rng.uniform(0.7, 0.95) * size
    uv = (xy - (lo + hi) / 2) / span * fill + size / 2
    h, _, _ = np.histogram2d(uv[:, 1], uv[:, 0], bins=size, range=[[0, size], [0, size]])
    h = np.log1p(h)
    if h.max() <= 0:
        return None
    return h / h.max()


def fractal_systems(count: int, *, seed: int, size: int = 32) -> list[np.ndarray]:
    """``count`` IFS classes; systems whose attractor covers under 5 % or over 60 % of its
    canvas (a dot, a line, a blob) are redrawn, as FractalDB filters by filling rate."""
    rng = np.random.default_rng(seed)
    systems: list[np.ndarray] = []
    while len(systems) < count:
        maps = _contractive_maps(rng, int(rng.integers(2, 5)))
        img = _draw_points(_chaos_game(maps, rng, 400), size, rng)
        if img is None:
            continue
        cover = float((img > 0.05).mean())
        if 0.05 <= cover <= 0.6:
            systems.append(maps)
    return systems


def fractals(count: int, n_per_class: int, *, size: int, seed: int) -> Task:
    """``count`` fractal classes, ``n_per_class`` images each (see the module docstring)."""
    systems = fractal_systems(count, seed=seed)
    rng = np.random.default_rng(seed + 1)
    n = count * n_per_class
    xs = np.empty((n, size, size, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(count, dtype=np.int64), n_per_class)
    points = 60 * size
    for i, label in enumerate(ys):
        img = None
        while img is None:
            maps = systems[label] * rng.uniform(0.9, 1.1, size=systems[label].shape)
            img = _draw_points(_chaos_game(maps, rng, points // 12), size, rng)
        fg, bg = rng.uniform(120, 255, size=3), rng.uniform(0, 80, size=3)
        pic = bg + img[..., None] * (fg - bg) + rng.normal(0, 8, (size, size, 3))
        xs[i] = np.clip(pic, 0, 255).round().astype(np.uint8)
    return xs, ys, [f"ifs{c}" for c in range(count)]


LEAF_SHAPES = ("disk", "square", "triangle", "bar")
LEAF_ALPHAS = (2.0, 2.6, 3.2, 3.8)


def _leaf(draw, kind: str, cx: float, cy: float, r: float, angle: float, colour) -> None:
    if kind == "disk":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
        return
    if kind == "square":
        corners = [(r, r), (-r, r), (-r, -r), (r, -r)]
    elif kind == "triangle":
        corners = [(r * np.cos(a), r * np.sin(a)) for a in (0, 2 * np.pi / 3, 4 * np.pi / 3)]
    else:  # a bar: 4:1
        corners = [(r, r / 4), (-r, r / 4), (-r, -r / 4), (r, -r / 4)]
    c, s = np.cos(angle), np.sin(angle)
    draw.polygon([(cx + c * x - s * y, cy + s * x + c * y) for x, y in corners], fill=colour)


def dead_leaves(n_per_class: int, *, size: int, seed: int) -> Task:
    """4 leaf shapes x 4 size exponents = 16 classes. Radii follow a power law
    p(r) ~ r^-alpha on [1 px, size/2] (drawn at twice the size, then averaged down, so edges
    are antialiased); leaves are painted back to front until 250 have fallen."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    names = [f"{k}-a{a:g}" for k in LEAF_SHAPES for a in LEAF_ALPHAS]
    n = len(names) * n_per_class
    xs = np.empty((n, size, size, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(len(names), dtype=np.int64), n_per_class)
    big = 2 * size
    rmin, rmax = 2.0, big / 2
    for i, label in enumerate(ys):
        kind = LEAF_SHAPES[label // len(LEAF_ALPHAS)]
        alpha = LEAF_ALPHAS[label % len(LEAF_ALPHAS)]
        base = rng.uniform(0, 255, size=3)  # a per-image palette around one colour
        canvas = Image.new("RGB", (big, big), tuple(int(v) for v in base))
        draw = ImageDraw.Draw(canvas)
        u = rng.random(250)  # inverse-CDF draw of the power law
        e = 1 - alpha
        radii = (rmin**e + u * (rmax**e - rmin**e)) ** (1 / e)
        for r in radii:
            colour = np.clip(base + rng.normal(0, 70, size=3), 0, 255)
            cx, cy = rng.uniform(-r, big + r, size=2)
            _leaf(draw, kind, cx, cy, r, rng.uniform(0, np.pi), tuple(int(v) for v in colour))
        small = canvas.resize((size, size), Image.Resampling.BOX)
        pic = np.asarray(small, dtype=np.float64) + rng.normal(0, 6, (size, size, 3))
        xs[i] = np.clip(pic, 0, 255).round().astype(np.uint8)
    return xs, ys, names


SPECTRA_ALPHAS = (0.8, 1.4, 2.0, 2.6)
SPECTRA_SHAPES = ("isotropic", "stretched-0", "stretched-90")


def spectra(n_per_class: int, *, size: int, seed: int) -> Task:
    """4 spectral exponents x 3 anisotropies (none, or 3:1 along a random angle within +-20
    degrees of 0 or of 90) = 12 classes. Each image: white noise filtered to amplitude
    1/f^alpha, then coloured (two fields of the same spectrum mixed through a random colour
    matrix), contrast normalised."""
    rng = np.random.default_rng(seed)
    names = [f"a{a:g}-{s}" for a in SPECTRA_ALPHAS for s in SPECTRA_SHAPES]
    n = len(names) * n_per_class
    xs = np.empty((n, size, size, 3), dtype=np.uint8)
    ys = np.repeat(np.arange(len(names), dtype=np.int64), n_per_class)
    fy, fx = np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij")
    for i, label in enumerate(ys):
        alpha = SPECTRA_ALPHAS[label // len(SPECTRA_SHAPES)]
        shape = SPECTRA_SHAPES[label % len(SPECTRA_SHAPES)]
        if shape == "isotropic":
            f = np.hypot(fx, fy)
        else:
            base = 0.0 if shape.endswith("-0") else np.pi / 2
            theta = base + rng.uniform(-np.pi / 9, np.pi / 9)
            u = fx * np.cos(theta) + fy * np.sin(theta)
            v = -fx * np.sin(theta) + fy * np.cos(theta)
            f = np.hypot(u / 3, v)
        f[0, 0] = 1.0
        amp = f**-alpha
        amp[0, 0] = 0.0
        fields = []
        for _ in range(2):
            spec = np.fft.fft2(rng.normal(size=(size, size))) * amp
            field = np.fft.ifft2(spec).real
            fields.append((field - field.mean()) / (field.std() + 1e-12))
        mix = rng.uniform(-1, 1, size=(3, 2))
        pic = np.einsum("ck,khw->hwc", mix, np.stack(fields))
        pic = 128 + rng.uniform(25, 45) * pic / (np.abs(mix).sum(1).max() + 1e-12) * 1.5
        xs[i] = np.clip(pic + rng.uniform(-40, 40, size=3), 0, 255).round().astype(np.uint8)
    return xs, ys, names
