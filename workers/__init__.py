"""The Celery face of the service: task bodies (``tasks``) over the service core, and the
trainer subprocess they follow (``training_runner``)."""
