"""The worker's Celery app: ``celery -A zoopick.workers.celery_app worker`` (or ``zoopick
worker``). Settings come from ``ZOOPICK_*``; everything else is the queue contract in
:mod:`zoopick.service.queue`."""

from zoopick.service.queue import make_celery
from zoopick.service.settings import get_settings

app = make_celery(get_settings(), include_tasks=True)
