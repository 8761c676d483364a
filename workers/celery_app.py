"""The worker's Celery app: ``celery -A zoopick.workers.celery_app worker`` (or ``zoopick
worker``). Settings come from ``ZOOPICK_*``; everything else is the queue contract in
:mod:`zoopick.service.queue`."""

from zoopick.service.queue import make_celery
from zoopick.service.settings import get_settings
from zoopick.workers import supervision  # noqa: F401 - a local worker dies with its serve
from zoopick.workers.lognoise import install as quiet_expected_events

app = make_celery(get_settings(), include_tasks=True)
quiet_expected_events()  # a cancelled job's revoked chord: one info line
