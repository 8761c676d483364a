"""The API sends tasks without subscribing to their results (celery/celery#3808).

Against the real Redis: Celery's stock Redis backend subscribes the sender to every sent
task's result channel, and nothing in zoopick ever drains it, so a long-lived API would keep
one subscription (and its unread messages) per task it ever sent.
"""

from __future__ import annotations

import uuid

import redis
from celery.backends.redis import RedisBackend

from zoopick.service.queue import make_celery
from zoopick.service.result_backend import SendOnlyRedisBackend, backend_url
from zoopick.service.settings import Settings


def test_a_sender_keeps_no_subscription_per_task(redis_url, tmp_path):
    url, prefix = redis_url
    prefix = f"{prefix}results-{uuid.uuid4().hex[:8]}:"
    app = make_celery(Settings(data_dir=tmp_path, broker_url=url, redis_key_prefix=prefix))
    client = redis.Redis.from_url(url)
    try:
        assert isinstance(app.backend, SendOnlyRedisBackend)
        for _ in range(3):  # to a queue no worker reads: nothing ever runs them
            app.send_task("zoopick.nothing", queue="nobody")
        assert client.pubsub_channels(f"{prefix}*") == []
        assert not app.backend.result_consumer.subscribed_to
        # Celery's own send-time hook subscribes on the server: the checks above can fail
        RedisBackend.on_task_call(app.backend, None, "t1")
        assert client.pubsub_channels(f"{prefix}*") == [f"{prefix}celery-task-meta-t1".encode()]
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        app.close()


def test_only_redis_urls_change():
    assert backend_url("file:///tmp/r") == "file:///tmp/r"
    assert backend_url("redis://h:1/0").endswith("SendOnlyRedisBackend+redis://h:1/0")
