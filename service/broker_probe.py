"""Which task messages the broker still holds: the sweeper's way to tell a job whose tasks wait
behind other work from one whose tasks the broker lost (``zoopick.service.recovery``).

A task message is *held* while it waits in its queue or while a worker has reserved it and not
acknowledged it yet; a held message will still run (or, a dead worker's, come back after the
visibility timeout). Per transport:

* **Redis** (kombu's ``redis``, and ``sentinel``, its subclass): a waiting message is an item of
  the queue's list (one list per priority step); a reserved one is a value of kombu's
  ``unacked`` hash. Read through kombu's own channel, so the deployment's
  ``global_keyprefix`` and key names apply as they do for the workers;
* **the embedded file broker** (``service.fsbroker``): a waiting message is a ``.msg`` file in
  the queue folder; kombu's file transport deletes it when a worker takes it, so a reserved
  message is no longer held (a worker killed then loses it for good);
* any other transport: cannot tell (``None``), and the caller keeps to what it did without.

Each message is a JSON envelope whose ``headers.id`` (Celery's message protocol 2; the
``correlation_id`` property too) is the task id. Bounded: at most :data:`MAX_MESSAGES`
messages are read in all; a broker holding more answers ``None`` (cannot tell), since the
scan would cost a sweep too much and a missing id would then prove nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from zoopick.service.queue import CPU, GPU, broker_options, make_celery
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

MAX_MESSAGES = 10_000
"""The most messages one probe reads (queues and reserved together)."""
JOB_QUEUES = (CPU, GPU)
"""Where a job's tasks wait: scoring on ``gpu``, selection on ``cpu``."""


class TooMany(Exception):
    """The broker holds more messages than one probe reads."""


def task_id(raw: str | bytes) -> str | None:
    """The task id of one message envelope (None when it is not a readable task message)."""
    try:
        envelope = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if isinstance(envelope, list) and envelope:  # kombu's unacked entry: [message, ex, key]
        envelope = envelope[0]
    if not isinstance(envelope, dict):
        return None
    headers = envelope.get("headers") or {}
    found = headers.get("id") or (envelope.get("properties") or {}).get("correlation_id")
    return str(found) if found else None


def held_task_ids(settings: Settings, queues: Iterable[str] = JOB_QUEUES) -> set[str] | None:
    """The ids of the task messages the broker holds on ``queues`` (waiting or reserved);
    ``None`` when it cannot tell (an unknown transport, more than :data:`MAX_MESSAGES`
    messages, the broker unreachable, the embedded broker's folder missing)."""
    queues = tuple(queues)
    try:
        if settings.embedded_broker:
            folder = Path(broker_options(settings)["data_folder_in"])
            if not folder.is_dir():  # not this machine's broker folder, or never made
                return None
            return {i for i in map(task_id, _files(folder, queues)) if i}
        return _redis(settings, queues)
    except TooMany:
        log.info("the broker holds over %d messages: cannot tell which tasks it holds",
                 MAX_MESSAGES)  # fmt: skip
        return None
    except Exception:  # noqa: BLE001 - the broker down: the sweep goes on without
        log.warning("could not read the broker's messages", exc_info=True)
        return None


def _files(folder: Path, queues: tuple[str, ...]) -> Iterator[bytes]:
    """The embedded broker's waiting messages in ``folder`` (one file each; a ``.part`` is not
    one yet)."""
    suffixes = tuple(f".{q}.msg" for q in queues)
    names = [p for p in folder.iterdir() if p.name.endswith(suffixes)]
    if len(names) > MAX_MESSAGES:
        raise TooMany()
    for path in names:
        try:
            yield path.read_bytes()
        except FileNotFoundError:  # taken by a worker meanwhile: no longer held
            continue


def _redis(settings: Settings, queues: tuple[str, ...]) -> set[str] | None:
    import redis
    from kombu.transport.redis import Channel as RedisChannel

    app = make_celery(settings)
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
        channel: Any = conn.default_channel
        if not isinstance(channel, RedisChannel):
            return None
        # kombu's own client prefixes only the commands kombu sends (not LRANGE, HSCAN): a plain
        # client on its connections, with the deployment's global_keyprefix spelled out
        client = redis.Redis(connection_pool=channel.client.connection_pool)
        prefix = channel.global_keyprefix or ""
        lists = list(dict.fromkeys(prefix + channel._q_for_pri(q, p) for q in queues
                                   for p in channel.priority_steps))  # fmt: skip
        unacked = prefix + channel.unacked_key
        waiting = [client.llen(name) for name in lists]
        reserved = client.hlen(unacked)
        if sum(waiting) + reserved > MAX_MESSAGES:
            raise TooMany()
        # one snapshot of the lists and the hash (MULTI/EXEC). kombu moves a message a worker
        # takes in two steps (BRPOP, then HSET): one taken in between is in neither, and the
        # caller's re-send then duplicates it, which the tasks tolerate (leases, upserts)
        with client.pipeline(transaction=True) as pipe:
            for name in lists:
                pipe.lrange(name, 0, MAX_MESSAGES - 1)
            pipe.hvals(unacked)
            found = pipe.execute()
        raws = [raw for part in found for raw in part]
        if len(raws) > MAX_MESSAGES:  # grew since counted
            raise TooMany()
        return {i for i in map(task_id, raws) if i}
