"""The embedded broker's transport (``service.fsbroker``) on real folders: a message file still
being written, or cut short by a sender killed mid-write, never reaches a consumer as a
message, and never stops it (kombu's own file transport raised ``JSONDecodeError`` in ``_get``
on such a file, seen after ``zoopick serve`` was killed and started again, issue 43)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection
from kombu.transport import filesystem

from zoopick.service import fsbroker
from zoopick.service.queue import broker_options, make_celery
from zoopick.service.settings import Settings


def channel(folder: Path, transport: type = fsbroker.Transport):
    """A channel of ``transport`` on the embedded broker's folders under ``folder``, as
    ``zoopick serve`` lays them out."""
    opts = broker_options(Settings(data_dir=folder))
    for key in ("data_folder_in", "control_folder"):
        Path(opts[key]).mkdir(parents=True, exist_ok=True)
    conn = Connection("filesystem://", transport=transport, transport_options=opts)
    return conn, conn.channel(), Path(opts["data_folder_in"])


def test_the_embedded_broker_uses_this_transport(tmp_path):
    app = make_celery(Settings(data_dir=tmp_path))
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, fsbroker.Transport)


def test_a_cut_short_message_file_is_never_taken_as_a_message(tmp_path, caplog):
    conn, ch, queue = channel(tmp_path)
    try:
        ch._put("cpu", {"body": "x" * 10_000, "n": 1})
        (whole,) = queue.iterdir()
        assert whole.name.endswith(".cpu.msg")  # complete once it has its name
        data = whole.read_bytes()
        assert json.loads(data)["n"] == 1
        whole.unlink()

        # what this transport's sender has on disk mid-write (or left when killed then):
        # not a message of any queue
        part = queue / (whole.name + fsbroker.PART)
        part.write_bytes(data[: len(data) // 2])
        with pytest.raises(Empty):
            ch._get("cpu")
        assert part.read_bytes() == data[: len(data) // 2]  # left alone

        # what kombu's own sender has on disk mid-write (or left when killed then): its final
        # name, half of it written; kombu's consumer stops on it ...
        cut = queue / whole.name
        cut.write_bytes(data[: len(data) // 2])
        stock_conn, stock, _ = channel(tmp_path, filesystem.Transport)
        try:
            with pytest.raises(json.JSONDecodeError):
                stock._get("cpu")
        finally:
            stock_conn.release()
        # ... this one drops it, says so, and takes the next message at the next poll
        cut.write_bytes(b"")  # an empty one, as kombu's sender left between open and write
        ch._put("cpu", {"n": 2})
        with caplog.at_level(logging.ERROR, logger=fsbroker.__name__), pytest.raises(Empty):
            ch._get("cpu")
        assert "dropped an unreadable message of queue cpu" in caplog.text
        assert ch._get("cpu") == {"n": 2}
        assert [p.name for p in queue.iterdir()] == [part.name]
    finally:
        conn.release()


def test_a_consumer_polling_while_messages_are_written_gets_each_whole(tmp_path):
    """A sender and a consumer at once, as the API (or a worker sending the next task) and
    ``serve``'s worker are: every message arrives whole, in order, once."""
    sender_conn, sender, _ = channel(tmp_path)
    reader_conn, reader, queue = channel(tmp_path)
    count, size = 200, 200_000
    errors: list[BaseException] = []

    def send() -> None:
        try:
            for n in range(count):
                sender._put("gpu", {"n": n, "body": "y" * size})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    got: list[int] = []
    writer = threading.Thread(target=send)
    writer.start()
    deadline = time.monotonic() + 60
    try:
        while len(got) < count and time.monotonic() < deadline:
            try:
                message = reader._get("gpu")
            except Empty:
                continue
            assert len(message["body"]) == size
            got.append(message["n"])
    finally:
        writer.join(60)
        sender_conn.release()
        reader_conn.release()
    assert not errors
    assert sorted(got) == list(range(count))
    assert not [p for p in os.listdir(queue) if p.endswith(fsbroker.PART)]
