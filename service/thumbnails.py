"""Small PNG thumbnails of a few images per class of a ready dataset, for the dashboard.

Made by the worker that validates the upload, from the dataset it has just loaded (within the
dataset limits, so what is shown is what gets scored), and kept beside the upload in
``<dataset folder>/thumbs/``. The API only ever reads those files: a page view never loads a
dataset (a 1.5 MB npz once cost the API process 3 GB per first view).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

PER_CLASS = 4
SIZE = 96
INDEX = "index.json"

log = logging.getLogger(__name__)


def write_thumbnails(
    dataset: Any, storage_path: str | Path, *, per_class: int = PER_CLASS
) -> dict[str, list[str]]:
    """Write thumbnails of the first ``per_class`` images of each class of ``dataset`` (a
    loaded ``zoopick.selection.data.TargetDataset``) beside ``storage_path``; returns the
    index ``{class name: [thumbnail file, ...]}``. Only those images are decoded."""
    from PIL import Image

    folder = Path(storage_path).parent / "thumbs"
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {str(name): [] for name in dataset.class_names}
    for i, label in enumerate(dataset.labels.tolist()):
        name = str(dataset.class_names[label])
        if len(out[name]) >= per_class:
            continue
        img = dataset.image(i)
        img.thumbnail((SIZE, SIZE))
        if max(img.size) < SIZE // 2:  # tiny images (16 px) upscaled to be seen, kept sharp
            scale = max(1, SIZE // max(img.size))
            img = img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        file = f"{len(out[name])}-{label}-{i}.png"
        (folder / file).write_bytes(buf.getvalue())
        out[name].append(file)
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(folder / INDEX)
    return out


def thumbnails(storage_path: str | Path) -> dict[str, list[str]]:
    """``{class name: [thumbnail file, ...]}`` of the dataset stored at ``storage_path``, as its
    validation wrote them; ``{}`` where there are none (validated before thumbnails were made
    at validation, or making them failed). Never loads the dataset."""
    index = Path(storage_path).parent / "thumbs" / INDEX
    try:
        return json.loads(index.read_text())
    except FileNotFoundError:
        return {}


def thumbnail_path(storage_path: str | Path, file: str) -> Path | None:
    """The thumbnail file ``file`` of that dataset, or None (names are checked against the
    index, so a request cannot walk out of the folder)."""
    folder = Path(storage_path).parent / "thumbs"
    known = {f for files in thumbnails(storage_path).values() for f in files}
    return folder / file if file in known else None
