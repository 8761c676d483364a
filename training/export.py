"""A fine-tuned model in the formats users deploy: a timm / Hugging Face Hub folder and ONNX.

The trainer writes plain safetensors (``FINAL_WEIGHTS``: the timm model's state dict). From it:

- **timm folder** (``config.json`` + ``model.safetensors``, the Hugging Face Hub layout timm
  reads), written by timm's own ``save_for_hf`` with the model's data config and class names:
  ``timm.create_model("local-dir:<folder>")`` loads it as it is, and
  ``timm.create_model(arch, pretrained=True, num_classes=n,
  pretrained_cfg_overlay=dict(file="<folder>/model.safetensors"))`` too. Shipped as a tar.
- **ONNX**, by ``torch.onnx.export`` (the torch.export-based exporter) with a dynamic batch
  axis: input ``pixel_values`` (N, C, H, W), normalised as ``config.json``'s mean and std say,
  output ``logits`` (N, classes).

Torch is imported here, so only workers call this (never the API process).
"""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ONNX_INPUT = "pixel_values"
ONNX_OUTPUT = "logits"
ONNX_OPSET = 18
TIMM_FOLDER = "timm"
FORMATS = ("timm", "onnx")


def load_finetuned(arch: str, weights: str | Path, num_classes: int) -> torch.nn.Module:
    """The timm model ``arch`` with the fine-tuned ``weights`` (strict), in eval mode."""
    import timm

    from zoopick.selection.zoo import load_state_dict

    model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    model.load_state_dict(load_state_dict(weights), strict=True)
    return model.eval()


def timm_folder(
    model: torch.nn.Module,
    data_config: dict[str, Any],
    label_names: Sequence[str],
    folder: str | Path,
) -> Path:
    """``config.json`` + ``model.safetensors`` in ``folder``, by timm's ``save_for_hf``."""
    from timm.models import save_for_hf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_for_hf(
        model,
        str(folder),
        model_config={"label_names": list(label_names)},
        safe_serialization=True,
        data_config=dict(data_config),
    )
    return folder


def tar_folder(folder: str | Path, path: str | Path) -> Path:
    """``folder`` as an uncompressed tar (safetensors do not compress) whose members sit under
    the folder's name; written atomically."""
    folder, path = Path(folder), Path(path)
    with (
        tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as tmp,
        tarfile.open(fileobj=tmp, mode="w") as tar,
    ):
        for member in sorted(folder.iterdir()):
            tar.add(member, arcname=f"{folder.name}/{member.name}")
    Path(tmp.name).replace(path)
    return path


def onnx_file(model: torch.nn.Module, data_config: dict[str, Any], path: str | Path) -> Path:
    """``model`` as ONNX at ``path`` (atomically), batch size dynamic."""
    path = Path(path)
    example = torch.randn(2, *data_config["input_size"])
    batch = torch.export.Dim("batch", min=1, max=65536)
    part = path.with_suffix(".onnx.part")
    program = torch.onnx.export(
        model,
        (example,),
        input_names=[ONNX_INPUT],
        output_names=[ONNX_OUTPUT],
        dynamic_shapes=({0: batch},),
        opset_version=ONNX_OPSET,
        verbose=False,
        # the exporter's own graph optimisation doubles the export's time; onnxruntime (and
        # other runtimes) optimise the graph when they load it anyway
        optimize=False,
    )
    program.save(str(part))
    part.replace(path)
    return path
