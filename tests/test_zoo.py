"""Zoo manifests: round trip, path resolution, weights, data configs and every error case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
import yaml

from zoopick.selection.zoo import (
    Zoo,
    ZooEntry,
    ZooError,
    load_state_dict,
    load_zoo,
    save_checkpoint,
    write_zoo,
)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _entry(**kw) -> dict:
    base = {"id": "m", "arch": "test_resnet", "weights": "none", "num_classes": 4}
    base.update(kw)
    return base


def _write(path: Path, models) -> Path:
    path.write_text(json.dumps({"models": models}))
    return path


# -- round trip and resolution ---------------------------------------------------------------


def test_round_trip_weights_identical(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=7)
    save_checkpoint(model, tmp_path / "ckpt" / "r.safetensors")
    manifest = write_zoo(
        [
            _entry(
                id="r",
                weights=str(tmp_path / "ckpt" / "r.safetensors"),  # absolute in, relative out
                num_classes=7,
                input_size=[3, 32, 32],
                mean=[0.5, 0.5, 0.5],
                std=[0.25, 0.25, 0.25],
                interpolation="bicubic",
                crop_pct=1.0,
                source="unit test",
                tags=["cnn", "test"],
            )
        ],
        tmp_path / "zoo.json",
    )
    raw = json.loads(manifest.read_text())["models"][0]
    assert raw["weights"] == "ckpt/r.safetensors"
    zoo = load_zoo(manifest)
    assert len(zoo) == 1 and zoo.ids == ["r"] and zoo.path == manifest.resolve()
    entry = zoo["r"]
    assert entry.weights == str((tmp_path / "ckpt" / "r.safetensors").resolve())
    assert entry.tags == ("cnn", "test") and entry.source == "unit test"
    loaded = entry.create_model()
    assert not loaded.training
    assert _same_weights(model, loaded)
    # the ZooEntry itself round-trips through write_zoo
    again = load_zoo(write_zoo(list(zoo), tmp_path / "copy.yaml"))["r"]
    assert again == entry


def test_relative_paths_resolve_against_manifest_folder(tiny_zoo, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path.parent)  # not the manifest's folder
    zoo = load_zoo(tiny_zoo)
    for entry in zoo:
        assert Path(entry.weights).is_absolute()
        assert Path(entry.weights).parent == tiny_zoo.parent.resolve() / "ckpt"
    # moving the whole folder keeps the manifest valid
    moved = tiny_zoo.parent.rename(tmp_path / "moved")
    assert load_zoo(moved / "zoo.json").ids == zoo.ids


def test_yaml_manifest(tmp_path):
    path = tmp_path / "zoo.yml"
    path.write_text(yaml.safe_dump({"models": [_entry(id="a"), _entry(id="b", tags=["x"])]}))
    assert load_zoo(path).ids == ["a", "b"]


def test_zoo_lookup_select_and_unknown_id(tiny_zoo):
    zoo = load_zoo(tiny_zoo)
    assert zoo.ids == ["tiny-resnet", "tiny-vit", "tiny-efficientnet"]
    assert zoo["tiny-vit"].arch == "test_vit"
    sub = zoo.select(["tiny-efficientnet", "tiny-resnet"])
    assert isinstance(sub, Zoo) and sub.ids == ["tiny-efficientnet", "tiny-resnet"]
    assert zoo.select("tiny-vit").ids == ["tiny-vit"]
    with pytest.raises(ZooError, match="nope.*tiny-resnet, tiny-vit"):
        zoo["nope"]
    with pytest.raises(ZooError, match="nope"):
        zoo.select(["tiny-vit", "nope"])


def test_none_weights_deterministic_from_id(tmp_path):
    zoo = load_zoo(_write(tmp_path / "z.json", [_entry(id="a"), _entry(id="b")]))
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a1 = zoo["a"].create_model()
    after = torch.rand(3)
    assert torch.equal(before, after)  # the caller's RNG stream is untouched
    a2 = zoo["a"].create_model()
    assert _same_weights(a1, a2)
    assert not _same_weights(a1, zoo["b"].create_model())
    assert zoo["a"].weights_digest() == "none:test_resnet:a"


def test_reset_head_for_num_classes(tiny_zoo):
    entry = load_zoo(tiny_zoo)["tiny-resnet"]
    source = entry.create_model()
    assert source.get_classifier().out_features == 10
    torch.manual_seed(0)
    tuned = entry.create_model(num_classes=3)
    assert tuned.get_classifier().out_features == 3
    # the backbone keeps the source weights
    s, t = source.state_dict(), tuned.state_dict()
    assert all(torch.equal(s[k], t[k]) for k in s if not k.startswith("fc."))
    # the new head is drawn from the caller's seed
    torch.manual_seed(0)
    again = entry.create_model(num_classes=3)
    assert torch.equal(again.get_classifier().weight, tuned.get_classifier().weight)
    assert entry.create_model(num_classes=10).get_classifier().out_features == 10


def test_pth_checkpoints_wrapped_and_prefixed(tmp_path):
    torch.manual_seed(1)
    model = timm.create_model("test_resnet", num_classes=4)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "a.pth")
    torch.save({"model": model.state_dict()}, tmp_path / "b.pt")
    torch.save(model.state_dict(), tmp_path / "c.bin")
    models = [
        _entry(id=n, weights=n + ext) for n, ext in (("a", ".pth"), ("b", ".pt"), ("c", ".bin"))
    ]
    zoo = load_zoo(_write(tmp_path / "z.json", models))
    for entry in zoo:
        assert _same_weights(model, entry.create_model())
    assert load_state_dict(tmp_path / "a.pth").keys() == model.state_dict().keys()


def test_weights_digest_is_content_hash(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=4)
    save_checkpoint(model, tmp_path / "a.safetensors")
    save_checkpoint(model, tmp_path / "b.safetensors")
    torch.manual_seed(1)
    save_checkpoint(timm.create_model("test_resnet", num_classes=4), tmp_path / "c.safetensors")
    zoo = load_zoo(
        _write(tmp_path / "z.json", [_entry(id=n, weights=f"{n}.safetensors") for n in "abc"])
    )
    import hashlib

    expected = hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    assert zoo["a"].weights_digest() == expected == zoo["b"].weights_digest()
    assert zoo["c"].weights_digest() != expected
    hub = ZooEntry("h", "test_resnet", "hub", 1000, {})
    assert hub.weights_digest() == "hub:test_resnet"


def test_data_config_defaults_and_overrides(tiny_zoo):
    zoo = load_zoo(tiny_zoo)
    entry = zoo["tiny-vit"]
    cfg = entry.data_config()
    assert cfg["input_size"] == (3, 32, 32)
    assert cfg["interpolation"] == "bilinear"  # test_vit's own default is bicubic
    assert cfg["crop_pct"] == 1.0 and cfg["mean"] == (0.5, 0.5, 0.5)
    assert cfg["crop_mode"] == "center"  # not overridden: timm's default
    assert entry.data_config(entry.create_model()) == cfg
    plain = ZooEntry("p", "test_vit", "none", 5, {})
    assert plain.data_config()["input_size"] == (3, 160, 160)


def test_entry_accepts_lists_from_callers():
    e = ZooEntry("x", "test_resnet", Path("/tmp/a.safetensors"), 3, None, None, ["a"])  # type: ignore[arg-type]
    assert e.tags == ("a",) and e.weights == "/tmp/a.safetensors" and e.overrides == {}
    assert hash(e) == hash(ZooEntry("x", "test_resnet", "/tmp/a.safetensors", 3))


# -- errors ----------------------------------------------------------------------------------


def test_missing_and_unparseable_manifest(tmp_path):
    with pytest.raises(ZooError, match="not found"):
        load_zoo(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ZooError, match="not valid JSON"):
        load_zoo(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("models: [a, : b")
    with pytest.raises(ZooError, match="not valid YAML"):
        load_zoo(tmp_path / "bad.yaml")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ZooError, match="'models'"):
        load_zoo(tmp_path / "list.json")


def test_no_models(tmp_path):
    with pytest.raises(ZooError, match="no models"):
        load_zoo(_write(tmp_path / "z.json", []))


def test_duplicate_id(tmp_path):
    with pytest.raises(ZooError, match="duplicate model id 'a'.*entries 0 and 2"):
        load_zoo(_write(tmp_path / "z.json", [_entry(id="a"), _entry(id="b"), _entry(id="a")]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arch": None}, r"model 'm' \(entry 1\): missing field\(s\) arch"),
        ({"color": "red"}, r"model 'm' \(entry 1\): unknown field\(s\) color"),
        ({"arch": "resnet9000"}, r"model 'm' \(entry 1\): unknown arch 'resnet9000'"),
        ({"num_classes": 0}, r"model 'm' \(entry 1\): num_classes must be a positive"),
        ({"num_classes": 2.5}, r"model 'm'.*num_classes must be a positive"),
        ({"num_classes": True}, r"model 'm'.*num_classes must be a positive"),
        ({"weights": "gone.safetensors"}, r"model 'm' \(entry 1\): checkpoint file not found"),
        ({"weights": "w.onnx"}, r"model 'm'.*unknown format"),
        ({"input_size": [3, 32]}, r"model 'm'.*input_size"),
        ({"input_size": [1, 32, 32]}, r"model 'm'.*input_size"),
        ({"mean": [0.5, 0.5]}, r"model 'm'.*mean must be a list of 3"),
        ({"std": [0.5, 0.0, 0.5]}, r"model 'm'.*std values must be positive"),
        ({"interpolation": "cubic"}, r"model 'm'.*interpolation must be one of"),
        ({"crop_pct": 0}, r"model 'm'.*crop_pct"),
        ({"crop_pct": "1"}, r"model 'm'.*crop_pct"),
        ({"crop_mode": "zoom"}, r"model 'm'.*crop_mode"),
        ({"tags": "cnn"}, r"model 'm'.*tags must be a list"),
        ({"source": 3}, r"model 'm'.*source must be a string"),
        ({"weights": "hub", "num_classes": 10}, r"model 'm'.*hub weights.*1000-class head"),
    ],
)
def test_entry_errors_name_the_entry(tmp_path, change, message):
    bad = _entry(**change)
    bad = {k: v for k, v in bad.items() if v is not None}
    with pytest.raises(ZooError, match=message):
        load_zoo(_write(tmp_path / "z.json", [_entry(id="ok"), bad]))


def test_entry_without_id_named_by_index(tmp_path):
    bad = _entry()
    del bad["id"]
    with pytest.raises(ZooError, match=r"model entry 1: missing field\(s\) id"):
        load_zoo(_write(tmp_path / "z.json", [_entry(id="ok"), bad]))
    with pytest.raises(ZooError, match="model entry 0: must be a mapping"):
        load_zoo(_write(tmp_path / "z.json", ["test_resnet"]))


def test_head_mismatch_detected(tmp_path):
    save_checkpoint(timm.create_model("test_resnet", num_classes=10), tmp_path / "r.safetensors")
    torch.save(timm.create_model("test_resnet", num_classes=10).state_dict(), tmp_path / "r.pth")
    for name in ("r.safetensors", "r.pth"):
        bad = _entry(id="wrong-head", weights=name, num_classes=6)
        with pytest.raises(ZooError, match=r"'wrong-head'.*head fc.weight has 10 outputs.*is 6"):
            load_zoo(_write(tmp_path / "z.json", [bad]))


def test_checkpoint_of_another_arch_detected(tmp_path):
    save_checkpoint(timm.create_model("test_vit", num_classes=4), tmp_path / "v.safetensors")
    with pytest.raises(ZooError, match=r"'m'.*does not match arch 'test_resnet'.*missing"):
        load_zoo(_write(tmp_path / "z.json", [_entry(weights="v.safetensors")]))


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "c.safetensors").write_bytes(b"garbage")
    with pytest.raises(ZooError, match="cannot read checkpoint"):
        load_zoo(_write(tmp_path / "z.json", [_entry(weights="c.safetensors")]))


def test_write_zoo_validates_fields(tmp_path):
    with pytest.raises(ZooError, match="num_classes"):
        write_zoo([_entry(num_classes=-1)], tmp_path / "z.json")
    assert not (tmp_path / "z.json").exists()
    # checkpoints need not exist yet when writing
    write_zoo([_entry(weights="later.safetensors")], tmp_path / "z.json")
    with pytest.raises(ZooError, match="not found"):
        load_zoo(tmp_path / "z.json")


# -- bounds on what an entry may cost a scoring job --------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"input_size": [3, 32, 32], "crop_pct": 0.0022},  # ~14,500 px images (the probe's)
        {"input_size": [3, 32, 32], "crop_pct": 1e-300},  # "int too large to convert to C long"
        {"input_size": [3, 32, 32], "crop_pct": 5e-324},  # 32 / crop_pct overflows to inf
        {"input_size": [3, 2048, 2048], "crop_pct": 0.02},
        {"crop_pct": 0.05},  # test_resnet's own 160 px input: 3,200 px
        {"input_size": [3, 2048, 1024]},  # test_resnet's own crop_pct, 0.875: 2,340 px
    ],
)
def test_a_small_crop_pct_cannot_get_round_the_input_size_bound(tmp_path, change):
    with pytest.raises(ZooError, match=r"model 'm'.*crop_pct.*input_size.*2048 px"):
        load_zoo(_write(tmp_path / "z.json", [_entry(**change)]))
    with pytest.raises(ZooError, match="crop_pct"):
        write_zoo([_entry(**change)], tmp_path / "w.json")


def test_the_resize_bound_is_timms_own_resize(tmp_path):
    """The side checked is the one timm's eval transform resizes to (floor(side / crop_pct)),
    and an entry resizing to exactly the bound is accepted."""
    from zoopick.selection.extract import _eval_transform
    from zoopick.selection.zoo import MAX_INPUT_SIDE, resize_side

    for size, crop_pct in (([3, 32, 32], 0.875), ([3, 32, 32], 32 / 2048), ([3, 48, 48], 0.3)):
        resize = _eval_transform({"input_size": size, "crop_pct": crop_pct}).transforms[0]
        assert resize.size == resize_side(size, crop_pct)
    edge = [_entry(id="edge", input_size=[3, 32, 32], crop_pct=32 / MAX_INPUT_SIDE)]
    edge.append(_entry(id="big", input_size=[3, MAX_INPUT_SIDE, MAX_INPUT_SIDE], crop_pct=1.0))
    assert load_zoo(_write(tmp_path / "z.json", edge)).ids == ["edge", "big"]


def test_a_head_beyond_any_real_model_is_refused(tmp_path):
    from zoopick.selection.zoo import MAX_NUM_CLASSES

    with pytest.raises(ZooError, match=r"model 'm'.*num_classes 1,000,000.*100,000"):
        load_zoo(_write(tmp_path / "z.json", [_entry(num_classes=1_000_000)]))
    ok = load_zoo(_write(tmp_path / "ok.json", [_entry(num_classes=MAX_NUM_CLASSES)]))
    assert ok["m"].num_classes == MAX_NUM_CLASSES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"std": [1e-300] * 3}, r"model 'm'.*std values must be between 1e-06 and 1e\+06"),
        ({"std": [1e300] * 3}, r"model 'm'.*std values must be between"),  # inf in float32
        ({"mean": [1e308] * 3}, r"model 'm'.*mean values must be between -1e\+06 and 1e\+06"),
        ({"mean": [0.5, -1e7, 0.5]}, r"model 'm'.*mean values must be between"),
    ],
)
def test_a_normalisation_that_is_never_finite_is_refused(tmp_path, change, message):
    with pytest.raises(ZooError, match=message):
        load_zoo(_write(tmp_path / "z.json", [_entry(**change)]))


def test_the_normalisation_bounds_keep_every_pixel_finite(tmp_path):
    from zoopick.selection.extract import normalise
    from zoopick.selection.zoo import MAX_NORM, MIN_STD

    extremes = [
        _entry(id="a", mean=[MAX_NORM] * 3, std=[MIN_STD] * 3),
        _entry(id="b", mean=[-MAX_NORM] * 3, std=[MIN_STD] * 3),
        _entry(id="c", mean=[MAX_NORM] * 3, std=[MAX_NORM] * 3),
    ]
    pixels = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 1, 1, 3).expand(1, 3, 1, 3)
    for entry in load_zoo(_write(tmp_path / "z.json", extremes)):
        assert torch.isfinite(normalise(pixels, entry.data_config(), "cpu")).all(), entry.id


def test_logits_over_the_bound_are_refused_before_the_forward_pass(tiny_npz, tmp_path, monkeypatch):
    """n x num_classes float32 logits over ``MAX_LOGITS_BYTES`` are refused naming the model
    and the bound, before the model is built (its checkpoint is not even there) and before
    anything is cached."""
    from zoopick.selection import extract as ex
    from zoopick.selection.data import load_dataset

    dataset = load_dataset(tiny_npz)
    n = len(dataset)
    cache = tmp_path / "cache"
    missing = ZooEntry("wide", "test_resnet", str(tmp_path / "gone.safetensors"), 10)
    monkeypatch.setattr(ex, "MAX_LOGITS_BYTES", n * 10 * 4 - 1)
    with pytest.raises(ZooError, match=rf"'wide'.*{n * 40:,} bytes.*bound of {n * 40 - 1:,}"):
        ex.extract(missing, dataset, cache_dir=cache)
    assert not cache.exists()
    monkeypatch.setattr(ex, "MAX_LOGITS_BYTES", n * 10 * 4)
    out = ex.extract(ZooEntry("fits", "test_resnet", "none", 10), dataset, cache_dir=cache)
    assert out.logits.shape == (n, 10)
