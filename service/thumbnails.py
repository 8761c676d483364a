"""Small PNG thumbnails of a few images per class of a ready dataset, for the dashboard.

Made once with the selection engine's own loader (so what is shown is what gets scored) and
kept beside the upload in ``<dataset folder>/thumbs/``; later views read the files.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

PER_CLASS = 4
SIZE = 96
INDEX = "index.json"


def thumbnails(storage_path: str | Path, *, per_class: int = PER_CLASS) -> dict[str, list[str]]:
    """``{class name: [thumbnail file, ...]}`` for the dataset stored at ``storage_path``,
    made on first call (a seeded subset of ``per_class`` images per class)."""
    folder = Path(storage_path).parent / "thumbs"
    index = folder / INDEX
    if index.is_file():
        return json.loads(index.read_text())
    from zoopick.selection.data import load_dataset

    data = load_dataset(storage_path, max_per_class=per_class, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {name: [] for name in data.class_names}
    for i, label in enumerate(data.labels):
        name = data.class_names[int(label)]
        img = data.image(i)
        img.thumbnail((SIZE, SIZE))
        if max(img.size) < SIZE // 2:  # tiny images (16 px) upscaled to be seen, kept sharp
            scale = max(1, SIZE // max(img.size))
            img = img.resize((img.width * scale, img.height * scale), resample=0)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        file = f"{len(out[name])}-{int(label)}-{i}.png"
        (folder / file).write_bytes(buf.getvalue())
        out[name].append(file)
    tmp = index.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(index)
    return out


def thumbnail_path(storage_path: str | Path, file: str) -> Path | None:
    """The thumbnail file ``file`` of that dataset, or None (names are checked against the
    index, so a request cannot walk out of the folder)."""
    folder = Path(storage_path).parent / "thumbs"
    index = folder / INDEX
    if not index.is_file():
        return None
    known = {f for files in json.loads(index.read_text()).values() for f in files}
    return folder / file if file in known else None
