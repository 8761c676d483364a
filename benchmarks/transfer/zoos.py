"""The suite's zoos, as specs: which architecture is pretrained on which source, how long, at
which input size. ``build_zoo.py --zoo NAME`` builds one; nothing else decides what a zoo holds.

Three zoos of different character (issue 20):

* ``base``: the benchmark's first zoo (Fashion-MNIST classes 0-5, procedural shapes and
  gratings, 1,000 Fashion-MNIST pixel clusters; 21 models, all at 32 px);
* ``fonts``: glyphs rendered from matplotlib's bundled DejaVu faces (52 letters, 10 digits,
  1,000 non-Latin characters, sans-or-serif); CNNs, ViTs and mobile nets at 32 px, one
  architecture at five training lengths (a quarter of an epoch to 8), features of 64 to 2,048
  dimensions, heads of 2 to 1,000;
* ``synth``: natural-image-like synthetic images (FractalDB-style fractals, dead leaves, 1/f
  noise) and a natural photo's rotations (a self-supervised pretext); colour, input sizes 32,
  48 and 64, features of 64 to 2,048, heads of 4 to 1,000.

Which targets are near which zoo's sources is stated in :data:`NEAR` (every target not listed
for a zoo is far from it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZooModel:
    """One checkpoint: ``source`` is a key of ``tasks.SOURCES`` or None (a seeded random
    initialisation); ``epochs`` may be a fraction (a partially trained model); ``size`` is the
    input size it is pretrained and used at (the manifest's ``input_size``)."""

    id: str
    arch: str
    source: str | None
    epochs: float
    tags: tuple[str, ...]
    size: int = 32


@dataclass(frozen=True)
class ZooSpec:
    name: str
    description: str
    models: tuple[ZooModel, ...]
    quick: tuple[str, ...]  # the model ids of ``suite.py --quick``: a few, cheap, varied
    needs_fmnist: bool = False  # its sources read Fashion-MNIST (the targets always may)

    def model(self, model_id: str) -> ZooModel:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(f"zoo {self.name!r} has no model {model_id!r}")


def _models(rows: tuple[tuple, ...]) -> tuple[ZooModel, ...]:
    models = tuple(ZooModel(*row) for row in rows)
    ids = [m.id for m in models]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate model ids in {ids}")
    return models


# id, arch, source, epochs, tags. Varied on purpose: source relevance, length, architecture.
BASE = ZooSpec(
    "base",
    "Fashion-MNIST classes 0-5, procedural shapes and gratings, 1,000 Fashion-MNIST pixel "
    "clusters; 10 small timm architectures at 32 px",
    _models(
        (
            ("fmnist6-resnet-e8", "test_resnet", "fmnist6", 8, ("cnn",)),
            ("fmnist6-resnet-e1", "test_resnet", "fmnist6", 1, ("cnn",)),
            ("fmnist6-convnext-e8", "test_convnext", "fmnist6", 8, ("cnn",)),
            ("fmnist6-vit-e8", "test_vit", "fmnist6", 8, ("vit",)),
            ("fmnist6-mobilenetv3-e4", "mobilenetv3_small_050", "fmnist6", 4, ("cnn", "mobile")),
            ("fmnist6-efficientnet-e2", "test_efficientnet", "fmnist6", 2, ("cnn",)),
            ("fmnist6-mambaout-e4", "test_mambaout", "fmnist6", 4, ("cnn",)),
            ("fmnist6-nfnet-e4", "test_nfnet", "fmnist6", 4, ("cnn",)),
            ("shapes4-resnet-e6", "test_resnet", "shapes4", 6, ("cnn",)),
            ("shapes4-byobnet-e6", "test_byobnet", "shapes4", 6, ("cnn",)),
            ("shapes4-vit2-e6", "test_vit2", "shapes4", 6, ("vit",)),
            ("shapes4-efficientnet-e1", "test_efficientnet", "shapes4", 1, ("cnn",)),
            ("stripes8-convnext-e6", "test_convnext", "stripes8", 6, ("cnn",)),
            ("stripes8-lcnet-e6", "lcnet_035", "stripes8", 6, ("cnn", "mobile")),
            ("stripes8-resnet-e2", "test_resnet", "stripes8", 2, ("cnn",)),
            ("random-resnet", "test_resnet", None, 0, ("cnn", "random")),
            ("random-vit", "test_vit", None, 0, ("vit", "random")),
            # many-class source heads (100 and 1,000 outputs), feature sizes 96 to 1,280
            ("stripes100-resnet-e3", "test_resnet", "stripes100", 3, ("cnn", "head100")),
            (
                "stripes100-mobilenetv3-e3",
                "mobilenetv3_small_050",
                "stripes100",
                3,
                ("cnn", "head100"),
            ),
            ("fmnist1000-resnet-e3", "test_resnet", "fmnist1000", 3, ("cnn", "head1000")),
            ("fmnist1000-lcnet-e3", "lcnet_035", "fmnist1000", 3, ("cnn", "head1000")),
        )
    ),
    quick=("fmnist6-resnet-e8", "shapes4-vit2-e6", "stripes8-lcnet-e6", "random-resnet"),
    needs_fmnist=True,
)

FONTS = ZooSpec(
    "fonts",
    "glyphs rendered from matplotlib's DejaVu faces (letters, digits, 1,000 non-Latin "
    "characters, sans-or-serif); CNNs, ViTs and mobile nets at 32 px",
    _models(
        (
            # one architecture at five training lengths, from a quarter of an epoch to eight
            ("latin52-resnet-q", "test_resnet", "latin52", 0.25, ("cnn", "partial")),
            ("latin52-resnet-e1", "test_resnet", "latin52", 1, ("cnn",)),
            ("latin52-resnet-e2", "test_resnet", "latin52", 2, ("cnn",)),
            ("latin52-resnet-e4", "test_resnet", "latin52", 4, ("cnn",)),
            ("latin52-resnet-e8", "test_resnet", "latin52", 8, ("cnn",)),
            ("latin52-vit4-e6", "test_vit4", "latin52", 6, ("vit",)),
            ("latin52-mobilevit-e4", "mobilevit_xxs", "latin52", 4, ("vit", "mobile")),
            ("latin52-resnet14t-e3", "resnet14t", "latin52", 3, ("cnn", "f2048")),
            ("unicode1000-resnet-e8", "test_resnet", "unicode1000", 8, ("cnn", "head1000")),
            ("unicode1000-regnetx-e4", "regnetx_002", "unicode1000", 4, ("cnn", "head1000")),
            (
                "unicode1000-efficientnet-e8",
                "test_efficientnet",
                "unicode1000",
                8,
                ("cnn", "head1000"),
            ),
            ("fontdigits10-lcnet-e4", "lcnet_050", "fontdigits10", 4, ("cnn", "mobile")),
            ("fontdigits10-vit2-e4", "test_vit2", "fontdigits10", 4, ("vit",)),
            ("face2-resnet-e3", "test_resnet", "face2", 3, ("cnn", "head2")),
            ("face2-mobilenetv2-e3", "mobilenetv2_050", "face2", 3, ("cnn", "mobile", "head2")),
            ("random-resnet14t", "resnet14t", None, 0, ("cnn", "random", "f2048")),
            ("random-mobilevit", "mobilevit_xxs", None, 0, ("vit", "mobile", "random")),
            ("random-resnet", "test_resnet", None, 0, ("cnn", "random")),
        )
    ),
    quick=("latin52-resnet-q", "latin52-resnet-e2", "fontdigits10-vit2-e4", "face2-resnet-e3"),
)

SYNTH = ZooSpec(
    "synth",
    "natural-image-like synthetic images (fractals, dead leaves, 1/f noise) and a photo's "
    "rotations; colour, input sizes 32 to 64",
    _models(
        (
            ("fractal1000-resnet18-e3", "resnet18", "fractal1000", 3, ("cnn", "head1000"), 32),
            (
                "fractal1000-mobilenetv3-e3",
                "mobilenetv3_small_075",
                "fractal1000",
                3,
                ("cnn", "mobile", "head1000"),
                64,
            ),
            ("fractal100-convnext-e4", "test_convnext", "fractal100", 4, ("cnn", "head100"), 48),
            ("fractal100-efficientnet-e4", "test_efficientnet", "fractal100", 4, ("cnn",), 32),
            # one architecture at four training lengths, from a tenth of an epoch to nine
            ("leaves16-resnet-d", "test_resnet", "leaves16", 0.1, ("cnn", "partial"), 48),
            ("leaves16-resnet-e1", "test_resnet", "leaves16", 1, ("cnn",), 48),
            ("leaves16-resnet-e3", "test_resnet", "leaves16", 3, ("cnn",), 48),
            ("leaves16-resnet-e9", "test_resnet", "leaves16", 9, ("cnn",), 48),
            ("leaves16-vit-e6", "test_vit", "leaves16", 6, ("vit",), 64),
            ("leaves16-edgenext-e4", "edgenext_xx_small", "leaves16", 4, ("vit", "mobile"), 64),
            ("spectra12-nfnet-e3", "test_nfnet", "spectra12", 3, ("cnn",), 32),
            ("spectra12-mambaout-e3", "test_mambaout", "spectra12", 3, ("cnn",), 48),
            ("rotations4-resnet50-e2", "resnet50", "rotations4", 2, ("cnn", "f2048"), 32),
            (
                "rotations4-mobilevitv2-e4",
                "mobilevitv2_050",
                "rotations4",
                4,
                ("vit", "mobile"),
                48,
            ),
            ("rotations4-vit4-e4", "test_vit4", "rotations4", 4, ("vit",), 48),
            ("random-resnet50", "resnet50", None, 0, ("cnn", "random", "f2048"), 32),
            ("random-edgenext", "edgenext_xx_small", None, 0, ("vit", "mobile", "random"), 64),
            ("random-resnet", "test_resnet", None, 0, ("cnn", "random"), 48),
        )
    ),
    quick=(
        "leaves16-resnet-e1",
        "fractal100-efficientnet-e4",
        "rotations4-vit4-e4",
        "random-resnet",
    ),
)

ZOOS: dict[str, ZooSpec] = {z.name: z for z in (BASE, FONTS, SYNTH)}

# Targets near each zoo's sources (same kind of image or a shared class); all others are far.
NEAR: dict[str, tuple[str, ...]] = {
    "base": ("fmnist4", "shirts2", "glyphs", "counts", "textures"),
    "fonts": ("letters", "chars62", "digits"),
    "synth": ("photo64", "textures"),
}
