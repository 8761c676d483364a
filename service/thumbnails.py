"""Small PNG thumbnails of a few images per class of a ready dataset, for the dashboard.

Made by the worker that validates the upload, from the dataset it has just loaded (within the
dataset limits, so what is shown is what gets scored), and kept in the store beside the
upload (``<dataset prefix>/thumbs/``, ``index.json`` written last: the set is complete once it
is there), or beside the file of a dataset uploaded before the store (``<folder>/thumbs/``).
The API only ever reads them: a page view never loads a dataset (a 1.5 MB npz once cost the
API process 3 GB per first view).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

from zoopick.service.storage import ObjectMissing, Store

PER_CLASS = 4
SIZE = 96
FOLDER = "thumbs"
INDEX = "index.json"

log = logging.getLogger(__name__)


def write_thumbnails(
    dataset: Any, folder: str | Path, *, per_class: int = PER_CLASS
) -> dict[str, list[str]]:
    """Write thumbnails of the first ``per_class`` images of each class of ``dataset`` (a
    loaded ``zoopick.selection.data.TargetDataset``) into ``folder``, ``index.json`` last;
    returns the index ``{class name: [thumbnail file, ...]}``. Only those images are
    decoded."""
    from PIL import Image

    folder = Path(folder)
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


def put_thumbnails(folder: Path, store: Store, prefix: str) -> None:
    """The thumbnails :func:`write_thumbnails` made in ``folder`` into the store under
    ``prefix`` (the index last), removed from ``folder`` as they go."""
    index = json.loads((folder / INDEX).read_text())
    for files in index.values():
        for file in files:
            store.put_file(f"{prefix}/{file}", folder / file, move=True)
    store.put_file(f"{prefix}/{INDEX}", folder / INDEX, move=True)


def thumbnails(where: str | Path, store: Store | None = None) -> dict[str, list[str]]:
    """``{class name: [thumbnail file, ...]}`` of a dataset's thumbnails in ``where``: a key
    prefix of ``store``, or a local folder (a dataset from before the store); ``{}`` where
    there are none (validated before thumbnails were made at validation, or making them
    failed). Never loads the dataset. ``StoreUnavailable`` where the store cannot say."""
    try:
        if store is None:
            return json.loads((Path(where) / INDEX).read_text())
        return json.loads(b"".join(store.get(f"{where}/{INDEX}")))
    except (FileNotFoundError, ObjectMissing):
        return {}


def thumbnail(where: str | Path, file: str, store: Store | None = None) -> Path | bytes | None:
    """The thumbnail ``file`` in ``where`` (as :func:`thumbnails`): a local file, or the
    object's bytes from a remote store; None where there is none (names are checked against
    the index, so a request cannot walk out of the folder)."""
    known = {f for files in thumbnails(where, store).values() for f in files}
    if file not in known:
        return None
    if store is None:
        return Path(where) / file
    key = f"{where}/{file}"
    local = store.local_path(key)
    if local is not None:
        return local if local.is_file() else None
    try:
        return b"".join(store.get(key))
    except ObjectMissing:
        return None
