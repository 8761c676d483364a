"""One exception per kind of problem, mapped from the API's RFC 9457 problem details.

Each carries the CLI's exit code for it (documented in ``zoopick.client.cli``), so a pipeline
can tell "the job failed" (1) from "you asked wrongly" (2), "it took too long" (3) and "the
server is not there or will not have you" (4).
"""

from __future__ import annotations

from typing import Any

EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_TIMEOUT = 3
EXIT_UNAVAILABLE = 4


class ZoopickError(Exception):
    """Base of every client error. ``problem`` is the server's problem document, if any."""

    exit_code = EXIT_BAD_INPUT

    def __init__(
        self, message: str, *, status: int | None = None, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.problem = problem or {}

    @property
    def kind(self) -> str | None:
        """The problem's kind: ``urn:zoopick:problem:<kind>`` -> ``<kind>``."""
        t = self.problem.get("type")
        return t.rsplit(":", 1)[-1] if isinstance(t, str) else None


class BadRequest(ZoopickError):
    """400, 413, 415, 422: the request is wrong (the message names what)."""


class NotFound(ZoopickError):
    """404: no such dataset, job, model or endpoint (for this tenant)."""


class Conflict(ZoopickError):
    """409: the resource is not in a state that allows this (dataset not ready, job done)."""


class Unauthorized(ZoopickError):
    """401 or 403: no key, a wrong or revoked key, or not an admin key."""

    exit_code = EXIT_UNAVAILABLE


class Unreachable(ZoopickError):
    """The server could not be reached (after the retries)."""

    exit_code = EXIT_UNAVAILABLE


class ServerError(ZoopickError):
    """5xx or 429 that persisted through the retries, or an answer that is not a zoopick
    server's (a page where the API's JSON was due; a 404 without its problem document)."""

    exit_code = EXIT_UNAVAILABLE


class WaitTimeout(ZoopickError):
    """A wait for a dataset or job ran out of time; the job itself goes on (``job`` holds
    its last state, when a job was waited for)."""

    exit_code = EXIT_TIMEOUT

    def __init__(self, message: str, job: Any = None) -> None:
        super().__init__(message)
        self.job = job


class JobFailed(ZoopickError):
    """A waited-for job ended ``failed`` or ``cancelled`` (``job`` holds it)."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, message: str, job: Any) -> None:
        super().__init__(message)
        self.job = job


def from_response(status: int, body: Any, fallback: str) -> ZoopickError:
    """The exception for an error response: its class from the status, its message the
    problem's ``detail`` (the API's own words)."""
    problem = body if isinstance(body, dict) else {}
    detail = problem.get("detail") or fallback
    message = f"{detail} (HTTP {status})"
    if status in (401, 403):
        cls: type[ZoopickError] = Unauthorized
    elif status == 404:
        cls = NotFound
    elif status == 409:
        cls = Conflict
    elif status >= 500 or status == 429:
        cls = ServerError
    else:
        cls = BadRequest
    return cls(message, status=status, problem=problem)
