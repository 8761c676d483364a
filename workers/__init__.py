"""Celery workers of the zoopick service (to come: see the service issue)."""
