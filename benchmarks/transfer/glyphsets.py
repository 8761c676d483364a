"""Glyph images rendered from fonts that installed packages bundle (no download, no system
fonts): matplotlib's DejaVu, STIX and Computer Modern files and Pillow's built-in font.

The `fonts` zoo pretrains on DejaVu faces only (:data:`SOURCE_FACES`); the `chars62` target is
drawn in the other faces (:data:`TARGET_FACES`), so the target's character shapes are near the
zoo's sources but its typefaces are not. Everything is seeded; a font file is identified by
its package's version (pinned in constraints.txt), so the pixels are reproducible.

Every generator returns ``(x, y, class_names)`` like :mod:`benchmarks.transfer.tasks`: ``x``
uint8 (N, size, size) grey.
"""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

Task = tuple[np.ndarray, np.ndarray, list[str]]

ALNUM62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
LATIN52 = string.ascii_uppercase + string.ascii_lowercase
SANS_FACES = (
    "DejaVuSans",
    "DejaVuSans-Bold",
    "DejaVuSans-Oblique",
    "DejaVuSans-BoldOblique",
    "DejaVuSansMono",
    "DejaVuSansMono-Bold",
)
SERIF_FACES = ("DejaVuSerif", "DejaVuSerif-Bold", "DejaVuSerif-Italic", "DejaVuSerif-BoldItalic")
SOURCE_FACES = SANS_FACES + SERIF_FACES
# faces the zoo never saw: Computer Modern (roman, sans, typewriter), STIX, Pillow's own font
TARGET_FACES = (
    "cmr10",
    "cmss10",
    "cmtt10",
    "STIXGeneral",
    "STIXGeneralBol",
    "STIXGeneralItalic",
    "pillow",
)
PILLOW = "pillow"  # Pillow's built-in scalable font (ImageFont.load_default)


@lru_cache(maxsize=1)
def font_dir() -> Path:
    """matplotlib's bundled TrueType folder (the ``bench`` extra installs matplotlib)."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "the glyph sources and targets render matplotlib's bundled fonts: "
            'pip install -e ".[bench]" -c constraints.txt'
        ) from exc
    return Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf"


@lru_cache(maxsize=256)
def _font(face: str, px: int):
    from PIL import ImageFont

    if face == PILLOW:
        return ImageFont.load_default(size=px)
    return ImageFont.truetype(str(font_dir() / f"{face}.ttf"), px)


@lru_cache(maxsize=16)
def _cmap(face: str) -> frozenset[int]:
    """Code points the face maps to a glyph of its own (not .notdef)."""
    from fontTools.ttLib import TTFont

    return frozenset(TTFont(str(font_dir() / f"{face}.ttf")).getBestCmap())


def render(
    classes: Sequence[tuple[Sequence[str], Sequence[str]]],
    names: Sequence[str],
    n_per_class: int,
    *,
    size: int,
    seed: int,
    rotate: float = 20.0,
    noise: float = 20.0,
) -> Task:
    """``n_per_class`` images of each class; a class is (texts, faces): every image draws one
    of its texts in one of its faces at a random size (45-80 % of the canvas), rotation
    (+-``rotate`` degrees) and offset, grey on a noisy background of random contrast."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    n = len(classes) * n_per_class
    xs = np.empty((n, size, size), dtype=np.uint8)
    ys = np.repeat(np.arange(len(classes), dtype=np.int64), n_per_class)
    shift = max(1, round(0.15 * size))
    for i, label in enumerate(ys):
        texts, faces = classes[label]
        text = texts[rng.integers(len(texts))]
        face = faces[rng.integers(len(faces))]
        font = _font(face, int(rng.integers(round(0.45 * size), round(0.8 * size) + 1)))
        canvas = Image.new("L", (2 * size, 2 * size))
        ImageDraw.Draw(canvas).text((size, size), text, fill=255, font=font, anchor="mm")
        canvas = canvas.rotate(rng.uniform(-rotate, rotate), resample=Image.Resampling.BILINEAR)
        dx, dy = rng.integers(-shift, shift + 1, size=2)
        box = (size // 2 + dx, size // 2 + dy, size // 2 + dx + size, size // 2 + dy + size)
        alpha = np.asarray(canvas.crop(box), dtype=np.float64) / 255.0
        bg, fg = rng.uniform(0, 90), rng.uniform(150, 255)
        if rng.random() < 0.5:  # either polarity: dark on light as often as light on dark
            bg, fg = 255 - bg, 255 - fg
        img = bg + alpha * (fg - bg) + rng.normal(0, noise, (size, size))
        xs[i] = np.clip(img, 0, 255).round().astype(np.uint8)
    return xs, ys, list(names)


def unicode_classes(count: int, *, seed: int) -> list[str]:
    """``count`` characters that every DejaVu Sans face draws, outside ASCII and the Latin
    alphabet (no accented Latin letters: those are the targets' letters in disguise), chosen
    with a seeded draw from the sorted eligible set."""
    faces = SANS_FACES[:4]
    common = frozenset.intersection(*(_cmap(f) for f in faces))
    eligible = []
    for cp in sorted(common):
        ch = chr(cp)
        cat = unicodedata.category(ch)
        if cp < 0xA0 or cat[0] not in "LNSP" or cat in ("Sk", "Lm"):
            continue
        if "LATIN" in unicodedata.name(ch, "LATIN"):
            continue
        eligible.append(ch)
    if len(eligible) < count:
        raise ValueError(f"only {len(eligible)} eligible characters, need {count}")
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(eligible, count, replace=False).tolist())


# --------------------------------------------------------------------------------------------
# the named sources (path and scale as tasks.SOURCES; size is the model's input size)


def latin52(n_per_class: int, *, size: int, seed: int) -> Task:
    """The 52 Latin letters (upper and lower case: 52 classes) in the DejaVu faces."""
    classes = [([c], SOURCE_FACES) for c in LATIN52]
    return render(classes, list(LATIN52), n_per_class, size=size, seed=seed)


def digits10(n_per_class: int, *, size: int, seed: int) -> Task:
    """The 10 digits in the DejaVu faces (typeset, unlike scikit-learn's handwritten ones)."""
    classes = [([c], SOURCE_FACES) for c in string.digits]
    return render(classes, list(string.digits), n_per_class, size=size, seed=seed)


def unicode1000(n_per_class: int, *, size: int, seed: int) -> Task:
    """1,000 non-Latin characters (Greek, Cyrillic, symbols, CJK-free: what DejaVu Sans has)
    in the four DejaVu Sans faces: a 1,000-output head trained on real glyph shapes."""
    chars = unicode_classes(1000, seed=seed)
    classes = [([c], SANS_FACES[:4]) for c in chars]
    names = [f"U+{ord(c):04X}" for c in chars]
    return render(classes, names, n_per_class, size=size, seed=seed + 1)


def face2(n_per_class: int, *, size: int, seed: int) -> Task:
    """Two classes, sans or serif, over random letters and digits: a 2-output head that has
    learnt typeface strokes, not character identity."""
    texts = list(ALNUM62)
    classes = [(texts, SANS_FACES), (texts, SERIF_FACES)]
    return render(classes, ["sans", "serif"], n_per_class, size=size, seed=seed)


def chars62(n_per_class: int, *, size: int, seed: int) -> Task:
    """The target: 62 classes (digits, upper and lower case) in faces the zoo never saw.
    Some pairs are ambiguous by nature (o/O/0, l/I/1, s/S, ...), as in EMNIST."""
    classes = [([c], TARGET_FACES) for c in ALNUM62]
    return render(classes, list(ALNUM62), n_per_class, size=size, seed=seed, noise=25.0)
