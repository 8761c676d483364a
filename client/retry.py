"""When and how long to retry: transient failures only, with capped exponential backoff.

Transient means the server may answer differently in a moment: the connection was refused or
reset, a gateway or the service said 502/503/504, or it asked us to slow down (429). A
``Retry-After`` header (seconds or an HTTP date) is honoured, capped by ``max_delay``.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

import httpx

RETRY_STATUSES = frozenset({429, 502, 503, 504})

# errors raised before the request reached the server: safe to retry any request
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# errors after it may have reached it: retried only for idempotent requests
MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    """Tries in all (1 = no retry)."""
    base_delay: float = 0.5
    max_delay: float = 30.0

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to sleep before try ``attempt + 1`` (``attempt`` counts from 1)."""
        if response is not None:
            after = retry_after(response.headers.get("retry-after"))
            if after is not None:
                return min(after, self.max_delay)
        backoff = self.base_delay * 2 ** (attempt - 1)
        return min(backoff * (0.5 + random.random() / 2), self.max_delay)


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now (RFC 9110: delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
