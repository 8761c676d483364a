"""Per-key rate limits on the expensive or abusable endpoints (uploads, job submission) and
per-client limits on failed authentication, with the ``limits`` library.

Counters live in Redis when the broker is Redis (so every API process of a deployment shares
them, under the deployment's key prefix) and in memory on the embedded setup (one API
process). A request over its limit is answered 429 with ``Retry-After`` (seconds until the
window resets) and the limit named (``ZOOPICK_RATE_UPLOADS=...``).
"""

from __future__ import annotations

import math
import time

from limits import parse
from limits.storage import MemoryStorage, RedisStorage, Storage
from limits.strategies import FixedWindowRateLimiter

from zoopick.app.problems import Problem
from zoopick.service.settings import Settings


class RateLimits:
    """The API process' limiter; ``check(name, identity)`` counts one request."""

    def __init__(self, settings: Settings) -> None:
        storage: Storage
        if settings.broker_url.startswith(("redis://", "rediss://")):
            storage = RedisStorage(
                settings.broker_url, key_prefix=f"{settings.redis_key_prefix}zoopick-rate"
            )
        else:
            storage = MemoryStorage()
        self.limiter = FixedWindowRateLimiter(storage)
        self.items = {
            "uploads": ("ZOOPICK_RATE_UPLOADS", settings.rate_uploads),
            "jobs": ("ZOOPICK_RATE_JOBS", settings.rate_jobs),
            "auth_failures": ("ZOOPICK_RATE_AUTH_FAILURES", settings.rate_auth_failures),
        }
        self.parsed = {name: parse(value) for name, (_, value) in self.items.items()}

    def _too_many(self, name: str, identity: str, what: str) -> Problem:
        item = self.parsed[name]
        reset = self.limiter.get_window_stats(item, name, identity).reset_time
        wait = max(1, math.ceil(reset - time.time()))
        env, value = self.items[name]
        return Problem(
            429,
            f"too many {what}: the limit is {value} ({env}); retry in {wait} s",
            kind="rate-limited",
            headers={"Retry-After": str(wait)},
        )

    def check(self, name: str, identity: str, what: str) -> None:
        """Count a request of ``identity`` against limit ``name``; 429 when over it."""
        if not self.limiter.hit(self.parsed[name], name, identity):
            raise self._too_many(name, identity, what)

    def blocked(self, name: str, identity: str, what: str) -> None:
        """429 if ``identity`` has used up limit ``name`` (without counting a request)."""
        if not self.limiter.test(self.parsed[name], name, identity):
            raise self._too_many(name, identity, what)

    def count(self, name: str, identity: str) -> None:
        self.limiter.hit(self.parsed[name], name, identity)
