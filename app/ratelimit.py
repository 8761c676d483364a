"""Per-key rate limits on the expensive or abusable endpoints (uploads, job submission) and
per-client limits on failed authentication, with the ``limits`` library.

Counters live in Redis when the broker is Redis (so every API process of a deployment shares
them, under the deployment's key prefix) and in memory on the embedded setup (one API
process). A request over its limit is answered 429 with ``Retry-After`` (seconds until the
window resets) and the limit named (``ZOOPICK_RATE_UPLOADS=...``).

A Redis that is down or does not answer never turns a request into a 500: the limiter logs a
warning and counts in this process' memory instead (the same limits, each API process
counting on its own), and tries Redis again :data:`STORE_RETRY_SECONDS` later. A limit thus
still bounds a client during the outage, by at most the number of API processes times it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from limits import RateLimitItem, parse
from limits.errors import StorageError
from limits.storage import MemoryStorage, RedisStorage
from limits.strategies import FixedWindowRateLimiter

from zoopick.app.problems import Problem
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_RETRY_SECONDS = 10.0
"""After the shared store failed, count in memory this long before trying it again (a store
that hangs costs one timeout per process and period, not one per request)."""

STORE_TIMEOUT_SECONDS = 2.0
"""Connect and read timeout of one call to the shared store."""


class RateLimits:
    """The API process' limiter; ``check(name, identity)`` counts one request."""

    def __init__(self, settings: Settings) -> None:
        self.shared: FixedWindowRateLimiter | None = None
        self.where = "memory"
        if settings.broker_url.startswith(("redis://", "rediss://")):
            storage = RedisStorage(
                settings.broker_url,
                key_prefix=f"{settings.redis_key_prefix}zoopick-rate",
                wrap_exceptions=True,  # every Redis failure is a limits.errors.StorageError
                socket_connect_timeout=STORE_TIMEOUT_SECONDS,
                socket_timeout=STORE_TIMEOUT_SECONDS,
            )
            self.shared = FixedWindowRateLimiter(storage)
            self.where = settings.broker_url.split("@")[-1]  # no password in a log line
        self.local = FixedWindowRateLimiter(MemoryStorage())
        self._down_until = 0.0  # time.monotonic() before which the shared store is not tried
        self._lock = threading.Lock()
        self.items = {
            "uploads": ("ZOOPICK_RATE_UPLOADS", settings.rate_uploads),
            "jobs": ("ZOOPICK_RATE_JOBS", settings.rate_jobs),
            "auth_failures": ("ZOOPICK_RATE_AUTH_FAILURES", settings.rate_auth_failures),
        }
        self.parsed = {name: parse(value) for name, (_, value) in self.items.items()}

    def _run(self, call: Callable[[FixedWindowRateLimiter], T]) -> tuple[T, FixedWindowRateLimiter]:
        """``call(limiter)`` on the shared store when it is up, else (or when it fails now)
        on the in-process one; returns the result and the limiter that gave it."""
        shared = self.shared
        if shared is not None and time.monotonic() >= self._down_until:
            try:
                result = call(shared)
            except StorageError as exc:
                with self._lock:
                    first = self._down_until == 0.0
                    self._down_until = time.monotonic() + STORE_RETRY_SECONDS
                if first:
                    log.warning(
                        "rate limits: the store at %s failed (%s); counting in this process' "
                        "memory until it answers again",
                        self.where,
                        exc,
                    )
            else:
                if self._down_until:
                    with self._lock:
                        self._down_until = 0.0
                    log.warning("rate limits: the store at %s answers again", self.where)
                return result, shared
        return call(self.local), self.local

    def _too_many(
        self, limiter: FixedWindowRateLimiter, name: str, identity: str, what: str
    ) -> Problem:
        item = self.parsed[name]
        try:
            reset = limiter.get_window_stats(item, name, identity).reset_time
        except StorageError:  # the store went away between the two calls
            reset = time.time() + item.get_expiry()
        wait = max(1, math.ceil(reset - time.time()))
        env, value = self.items[name]
        return Problem(
            429,
            f"too many {what}: the limit is {value} ({env}); retry in {wait} s",
            kind="rate-limited",
            headers={"Retry-After": str(wait)},
        )

    def _hit(self, item: RateLimitItem, name: str, identity: str):
        return self._run(lambda limiter: limiter.hit(item, name, identity))

    def check(self, name: str, identity: str, what: str) -> None:
        """Count a request of ``identity`` against limit ``name``; 429 when over it."""
        allowed, limiter = self._hit(self.parsed[name], name, identity)
        if not allowed:
            raise self._too_many(limiter, name, identity, what)

    def blocked(self, name: str, identity: str, what: str) -> None:
        """429 if ``identity`` has used up limit ``name`` (without counting a request)."""
        item = self.parsed[name]
        allowed, limiter = self._run(lambda limiter: limiter.test(item, name, identity))
        if not allowed:
            raise self._too_many(limiter, name, identity, what)

    def count(self, name: str, identity: str) -> None:
        self._hit(self.parsed[name], name, identity)
