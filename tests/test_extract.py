"""Extraction: outputs equal an independent timm pipeline; disk and decode caches."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.data import create_transform

from zoopick.selection import extract as extract_mod
from zoopick.selection.data import TargetDataset, load_dataset
from zoopick.selection.extract import (
    cache_key,
    clear_preprocess_cache,
    default_device,
    extract,
    preprocess,
)
from zoopick.selection.zoo import ZooEntry, load_zoo, save_checkpoint


@pytest.fixture(autouse=True)
def _fresh_decode_cache_one_thread():
    """Empty decode cache per test; one torch thread (tiny models on shared cores run many
    times slower with intra-op threads fighting over them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clear_preprocess_cache()
    yield
    clear_preprocess_cache()
    torch.set_num_threads(threads)


def _reference(model: torch.nn.Module, ds: TargetDataset, cfg: dict) -> np.ndarray:
    """model(x) on images through timm's own PIL eval transform (incl. normalisation)."""
    tf = create_transform(**cfg, is_training=False)
    x = torch.stack([tf(ds.image(i)) for i in range(len(ds))])
    with torch.no_grad():
        return model.eval()(x).numpy()


@pytest.mark.parametrize("model_id", ["tiny-resnet", "tiny-vit", "tiny-efficientnet"])
def test_logits_equal_model_forward(tiny_zoo, tiny_npz, model_id):
    entry = load_zoo(tiny_zoo)[model_id]
    ds = load_dataset(tiny_npz)
    out = extract(entry, ds, batch_size=10, device="cpu")
    assert not out.cached and out.seconds > 0
    assert out.logits.dtype == np.float32 and out.features.dtype == np.float32
    assert out.logits.shape == (len(ds), entry.num_classes)
    model = entry.create_model()
    assert out.features.shape == (len(ds), model.num_features)
    want = _reference(model, ds, entry.data_config(model))
    np.testing.assert_allclose(out.logits, want, rtol=1e-4, atol=1e-5)
    # the features are what the classifier maps to the logits
    head = model.get_classifier()
    with torch.no_grad():
        from_features = head(torch.from_numpy(out.features)).numpy()
    np.testing.assert_allclose(from_features, out.logits, rtol=1e-4, atol=1e-5)


def test_resize_and_crop_follow_data_config(tmp_path):
    """A 40x56 image through crop_pct 0.875 / bicubic / 48px: same as timm's PIL transform."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (6, 40, 56, 3), dtype=np.uint8)
    ds = TargetDataset.from_arrays(x, np.array([0, 1] * 3))
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=3)
    save_checkpoint(model, tmp_path / "m.safetensors")
    overrides = {"input_size": [3, 48, 48], "interpolation": "bicubic", "crop_pct": 0.875}
    entry = ZooEntry("m", "test_resnet", str(tmp_path / "m.safetensors"), 3, overrides)
    cfg = entry.data_config()
    u8 = preprocess(ds, cfg)
    assert u8.dtype == torch.uint8 and u8.shape == (6, 3, 48, 48)
    plain = create_transform(**cfg, is_training=False, normalize=False)
    assert torch.equal(u8[4], plain(ds.image(4)))
    out = extract(entry, ds, device="cpu")
    np.testing.assert_allclose(out.logits, _reference(model, ds, cfg), rtol=1e-4, atol=1e-5)


def test_disk_cache_hit_needs_no_model(tiny_zoo, tiny_npz, tmp_path, monkeypatch):
    entry = load_zoo(tiny_zoo)["tiny-resnet"]
    ds = load_dataset(tiny_npz)
    cache = tmp_path / "cache"
    first = extract(entry, ds, cache_dir=cache, device="cpu")
    assert not first.cached
    files = list(cache.glob("*.npz"))
    assert len(files) == 1 and not list(cache.glob("*.tmp"))

    class Exploding(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("forward called on a cache hit")

    def no_model(self, **kw):
        raise AssertionError("model created on a cache hit")

    monkeypatch.setattr(ZooEntry, "create_model", no_model)
    monkeypatch.setattr(extract_mod, "preprocess", lambda *a, **k: pytest.fail("decoded"))
    again = extract(entry, ds, cache_dir=cache, device="cpu")
    assert again.cached and again.seconds == 0.0
    assert np.array_equal(again.logits, first.logits)
    assert np.array_equal(again.features, first.features)
    hit = extract(entry, ds, cache_dir=cache, device="cpu", model=Exploding())
    assert hit.cached


def test_damaged_cache_file_is_recomputed(tiny_zoo, tiny_npz, tmp_path):
    entry = load_zoo(tiny_zoo)["tiny-efficientnet"]
    ds = load_dataset(tiny_npz)
    cache = tmp_path / "cache"
    first = extract(entry, ds, cache_dir=cache, device="cpu")
    (path,) = cache.glob("*.npz")
    path.write_bytes(b"truncated")
    again = extract(entry, ds, cache_dir=cache, device="cpu")
    assert not again.cached and np.allclose(again.logits, first.logits)
    assert extract(entry, ds, cache_dir=cache, device="cpu").cached


def test_cache_key_changes_with_weights_dataset_and_transform(tiny_zoo, tiny_npz, tmp_path):
    zoo = load_zoo(tiny_zoo)
    ds = load_dataset(tiny_npz)
    entry = zoo["tiny-resnet"]
    cfg = entry.data_config()
    key = cache_key(entry, ds, cfg)
    assert key == cache_key(entry, load_dataset(tiny_npz), dict(cfg))
    # same weights under another id and path: same key
    clone = ZooEntry("other-id", entry.arch, entry.weights, entry.num_classes, entry.overrides)
    assert cache_key(clone, ds, cfg) == key
    # other weights (same arch and head)
    torch.manual_seed(99)
    save_checkpoint(timm.create_model("test_resnet", num_classes=10), tmp_path / "w.safetensors")
    retrained = ZooEntry("r", "test_resnet", str(tmp_path / "w.safetensors"), 10, entry.overrides)
    others = {
        "weights": cache_key(retrained, ds, cfg),
        "dataset": cache_key(entry, ds.subset(range(10)), cfg),
        "size": cache_key(entry, ds, {**cfg, "input_size": (3, 40, 40)}),
        "mean": cache_key(entry, ds, {**cfg, "mean": (0.4, 0.5, 0.5)}),
        "precision": cache_key(entry, ds, cfg, precision="bf16"),
    }
    assert key not in others.values() and len(set(others.values())) == len(others)
    # a different dataset misses the disk cache
    extract(entry, ds, cache_dir=tmp_path / "c", device="cpu")
    assert not extract(entry, ds.subset(range(12)), cache_dir=tmp_path / "c", device="cpu").cached
    assert len(list((tmp_path / "c").glob("*.npz"))) == 2


def test_decode_once_across_models_with_same_config(tiny_zoo, tiny_npz, monkeypatch):
    zoo = load_zoo(tiny_zoo)
    ds = load_dataset(tiny_npz)
    calls = []
    original = TargetDataset.image

    def counting(self, i):
        calls.append(i)
        return original(self, i)

    monkeypatch.setattr(TargetDataset, "image", counting)
    for entry in zoo:  # all three share input size, interpolation and crop
        extract(entry, ds, device="cpu")
    assert len(calls) == len(ds)
    # a different transform decodes again; a different dataset too
    entry = zoo["tiny-resnet"]
    preprocess(ds, {**entry.data_config(), "input_size": (3, 24, 24)})
    assert len(calls) == 2 * len(ds)
    extract(entry, ds.subset(range(5)), device="cpu")
    assert len(calls) == 2 * len(ds) + 5


def test_given_model_is_used(tiny_zoo, tiny_npz):
    entry = load_zoo(tiny_zoo)["tiny-vit"]
    ds = load_dataset(tiny_npz)
    model = entry.create_model()
    a = extract(entry, ds, model=model, device="cpu")
    b = extract(entry, ds, device="cpu")
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-6)


def test_imagefolder_dataset_and_default_device(tiny_zoo, tiny_imagefolder):
    entry = load_zoo(tiny_zoo)["tiny-resnet"]
    ds = load_dataset(tiny_imagefolder)
    out = extract(entry, ds)  # default device
    assert out.logits.shape == (24, 10)
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert np.isfinite(out.features).all()


def test_the_bounds_are_arguments_with_the_services_defaults(tiny_zoo, tiny_npz, monkeypatch):
    """``max_logits_bytes`` and ``preprocess_cache_bytes`` are the caller's (the service
    passes its settings, whose defaults are the library's); a caller that passes none gets
    the library's default. The library reads no ``ZOOPICK_*`` variable (Settings declares
    and validates them): one set in the process changes nothing here."""
    from zoopick.selection.rank import score_model
    from zoopick.selection.zoo import ZooError
    from zoopick.service.settings import Settings

    defaults = Settings.model_fields
    assert defaults["max_logits_bytes"].default == extract_mod.MAX_LOGITS_BYTES
    assert defaults["preprocess_cache_bytes"].default == extract_mod.PREPROCESS_CACHE_BYTES
    entry = load_zoo(tiny_zoo)["tiny-resnet"]
    ds = load_dataset(tiny_npz)
    need = len(ds) * entry.num_classes * 4
    with pytest.raises(ZooError, match=f"bound of {need - 1:,} bytes"):
        score_model(entry, ds, ["leep"], device="cpu", max_logits_bytes=need - 1)
    monkeypatch.setenv("ZOOPICK_MAX_LOGITS_BYTES", str(need - 1))
    monkeypatch.setenv("ZOOPICK_PREPROCESS_CACHE_BYTES", "0")
    with pytest.raises(ZooError, match=f"bound of {need - 1:,} bytes"):
        extract(entry, ds, device="cpu", max_logits_bytes=need - 1)
    out = extract(entry, ds, device="cpu", max_logits_bytes=need, preprocess_cache_bytes=0)
    assert out.logits.shape == (len(ds), entry.num_classes)
    assert not extract_mod._PREPROCESSED  # a budget of 0 keeps no decoded images
    out = extract(entry, ds, device="cpu")  # the variables are not read: the defaults
    assert out.logits.shape == (len(ds), entry.num_classes)
    assert len(extract_mod._PREPROCESSED) == 1
    extract_mod.clear_preprocess_cache()
    preprocess(ds, entry.data_config(), cache_bytes=0)
    assert not extract_mod._PREPROCESSED
    preprocess(ds, entry.data_config())
    assert len(extract_mod._PREPROCESSED) == 1
