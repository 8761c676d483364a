"""Small real checkpoints for zoo registration tests (random weights, timm's tiny test archs)."""

from __future__ import annotations

from pathlib import Path


def write_checkpoint(path: Path, num_classes: int, arch: str = "test_resnet") -> Path:
    """A safetensors checkpoint of ``arch`` with a ``num_classes`` head."""
    import timm
    import torch

    from zoopick.selection.zoo import save_checkpoint

    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    return save_checkpoint(model, path)
