"""Which task messages the broker still holds (``service.broker_probe``), on a real Redis (a key
space of this test's own, under a deployment key prefix) and on the embedded broker's real
folder: a queued message and one a consumer reserved are found by task id, one taken and
acknowledged (or deleted) is not; a broker that cannot tell says so (None)."""

from __future__ import annotations

import uuid

from zoopick.service import broker_probe
from zoopick.service.dispatch import Dispatcher
from zoopick.service.queue import SCORE, SELECT, broker_options, make_celery
from zoopick.service.settings import Settings


def send(dispatcher: Dispatcher, name: str, task_id: str, **options) -> None:
    """A task message as the dispatcher sends it, with the task's own arguments (a process
    where the worker's tasks are imported checks them: the suite's order decides that)."""
    args = ("job", "model") if name == SCORE else ("job",)
    dispatcher._sig(name, *args, task_id=task_id).apply_async(**options)


def test_redis_queued_and_reserved_messages_are_held_and_taken_ones_are_not(redis_url, tmp_path):
    url, prefix = redis_url
    settings = Settings(
        data_dir=tmp_path, broker_url=url, redis_key_prefix=f"{prefix}probe-{uuid.uuid4().hex[:6]}:"
    )
    dispatcher = Dispatcher(settings)
    assert broker_probe.held_task_ids(settings) == set()
    send(dispatcher, SCORE, "a")  # gpu
    send(dispatcher, SCORE, "b")
    send(dispatcher, SELECT, "c")  # cpu
    send(dispatcher, SCORE, "d", priority=9)  # a priority step's list of its own
    other = settings.model_copy(update={"redis_key_prefix": settings.redis_key_prefix + "x:"})
    send(Dispatcher(other), SCORE, "elsewhere")  # another deployment's key space
    assert broker_probe.held_task_ids(settings) == {"a", "b", "c", "d"}

    app = make_celery(settings)
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        reserved = channel.basic_get("gpu", no_ack=False)  # a worker took it, not acked yet
        assert reserved is not None
        first = reserved.headers["id"]
        assert broker_probe.held_task_ids(settings) == {"a", "b", "c", "d"}
        taken = channel.basic_get("gpu", no_ack=True)  # taken and gone
        assert broker_probe.held_task_ids(settings) == {"a", "b", "c", "d"} - {taken.headers["id"]}
        reserved.ack()
        held = broker_probe.held_task_ids(settings)
        assert held == {"a", "b", "c", "d"} - {taken.headers["id"], first}
    assert broker_probe.held_task_ids(other) == {"elsewhere"}


def test_redis_more_messages_than_read_cannot_tell(redis_url, tmp_path, monkeypatch):
    url, prefix = redis_url
    settings = Settings(
        data_dir=tmp_path, broker_url=url, redis_key_prefix=f"{prefix}probe-{uuid.uuid4().hex[:6]}:"
    )
    dispatcher = Dispatcher(settings)
    for i in range(3):
        send(dispatcher, SCORE, f"t{i}")
    monkeypatch.setattr(broker_probe, "MAX_MESSAGES", 2)
    assert broker_probe.held_task_ids(settings) is None
    monkeypatch.setattr(broker_probe, "MAX_MESSAGES", 3)
    assert broker_probe.held_task_ids(settings) == {"t0", "t1", "t2"}


def test_the_embedded_brokers_message_files(tmp_path):
    settings = Settings(data_dir=tmp_path)
    assert broker_probe.held_task_ids(settings) is None  # no folder: not this machine's broker
    dispatcher = Dispatcher(settings)  # makes the folders on first send
    send(dispatcher, SCORE, "a")
    send(dispatcher, SELECT, "b")
    assert broker_probe.held_task_ids(settings) == {"a", "b"}
    folder = tmp_path / "broker" / "queue"
    assert str(folder) == broker_options(settings)["data_folder_in"]
    (whole,) = [p for p in folder.iterdir() if p.name.endswith(".gpu.msg")]
    (folder / (whole.name.replace("gpu.msg", "cpu.msg") + ".part")).write_bytes(
        whole.read_bytes()
    )  # a message still being written is not one yet
    (folder / "1_x.gpu.msg").write_bytes(b'{"headers": {"id": "cut')  # cut short: unreadable
    assert broker_probe.held_task_ids(settings) == {"a", "b"}

    app = make_celery(settings)
    with app.connection_for_read() as conn:
        taken = conn.default_channel.basic_get("cpu", no_ack=False)  # the file goes at once
        assert taken.headers["id"] == "b"
        assert broker_probe.held_task_ids(settings) == {"a"}  # only the consumer has it now
        taken.ack()
    assert broker_probe.held_task_ids(settings) == {"a"}


def test_another_transport_cannot_tell(tmp_path):
    settings = Settings(data_dir=tmp_path, broker_url="memory://", result_backend="cache+memory://")
    send(Dispatcher(settings), SCORE, "a")
    assert broker_probe.held_task_ids(settings) is None
