"""Webhooks: a signed POST of the job's summary on every terminal state (and, when asked, on
each phase change), delivered by a Celery task with retries and logged per delivery.

*Outbox.* :func:`enqueue` is called by ``pipeline.transition`` in the transaction that moves
the job, and writes a ``webhook_deliveries`` row there: the event exists exactly when the move
does. The delivery task is sent once that transaction commits (a session ``after_commit``
hook), so it always finds its row; the request or task that moved the job never waits on the
receiver.

*Signature.* Each request carries ``Zoopick-Signature: t=<unix time>,v1=<hex>``, where ``hex``
is HMAC-SHA256, keyed with the tenant's secret (``GET /api/v1/webhook``), of
``"<t>." + <raw request body>``. A receiver recomputes it over the bytes it received, compares
in constant time and refuses a ``t`` older than a few minutes (replays); see docs/integrations.md.

*Where to.* The URL is checked by ``zoopick.service.netguard`` when it is given and again at
each try, which connects to the checked address; redirects are not followed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.service import netguard, outbox
from zoopick.service.db.models import TERMINAL, Job, JobStatus, Tenant, WebhookDelivery
from zoopick.service.db.types import utcnow
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Zoopick-Signature"
EVENT_HEADER = "Zoopick-Event"
DELIVERY_HEADER = "Zoopick-Delivery"
TOP_RANKED = 5


class WebhookOptions(BaseModel):
    """Where a job's (or a tenant's) events go."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(
        max_length=netguard.MAX_URL_LENGTH,
        description="http(s) URL called with a signed POST of the job's summary.",
    )
    phases: bool = Field(
        False,
        description="Also call it on phase changes (scoring, racing, training), not only on "
        "succeeded, failed and cancelled.",
    )

    @field_validator("url")
    @classmethod
    def _shape(cls, value: str) -> str:
        try:
            netguard.split(value)
        except netguard.Refused as exc:
            raise ValueError(str(exc)) from None
        return value


def check_url(url: str, settings: Settings) -> str | None:
    """Why the service may not call ``url`` (resolved now), or None."""
    try:
        netguard.resolve(url, netguard.networks(settings.webhook_allow_networks))
    except netguard.Refused as exc:
        return str(exc)
    return None


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The ``v1`` value: hex HMAC-SHA256 of ``b"<timestamp>." + body``."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def secret_of(tenant: Tenant) -> str:
    """The tenant's signing secret, made on first use."""
    if not tenant.webhook_secret:
        tenant.webhook_secret = secrets.token_hex(32)
    return tenant.webhook_secret


# -- the outbox ----------------------------------------------------------------------------------


def _target(job: Job, tenant: Tenant) -> WebhookOptions | None:
    """Where ``job``'s events go: its own webhook, else its tenant's. The job's was validated
    when it was submitted and is read as stored (a delivery checks the address itself, with
    ``check_url``, whatever rules held then)."""
    if job.webhook:
        return WebhookOptions.model_construct(**job.webhook)
    if tenant.webhook_url:
        return WebhookOptions(url=tenant.webhook_url, phases=tenant.webhook_phases)
    return None


def summary(session: Session, job: Job) -> dict[str, Any]:
    """What a receiver gets: the job's state, and its best models when it finished."""
    from zoopick.service.pipeline import ranking

    stamp = {
        k: (getattr(job, k).isoformat() if getattr(job, k) else None)
        for k in ("created_at", "started_at", "finished_at")
    }
    body = {
        "id": str(job.id),
        "status": job.status,
        "progress": job.progress,
        "error": job.error,
        "dataset_id": str(job.dataset_id) if job.dataset_id else None,
        "models": job.models,
        "metrics": job.metrics,
        "select_by": job.select_by,
        "chosen_model": job.chosen_model,
        "cancel_requested": job.cancel_requested,
        **stamp,
    }
    if job.status in TERMINAL:
        body["ranking"] = ranking(session, job)[:TOP_RANKED]
    return body


def enqueue(session: Session, job_id: uuid.UUID, status: JobStatus) -> WebhookDelivery | None:
    """Record the event of the job having moved to ``status`` if its webhook wants it; the
    delivery task goes out when the transaction commits."""
    wanted = session.execute(
        select(Job.webhook, Tenant.webhook_url).join(Tenant).where(Job.id == job_id)
    ).first()
    if wanted is None or not (wanted[0] or wanted[1]):  # the common case: one cheap read
        return None
    # the move was an UPDATE statement: refresh the loaded row (earlier changes were flushed
    # before it ran)
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        return None
    tenant = session.get(Tenant, job.tenant_id)
    target = _target(job, tenant) if tenant is not None else None
    if target is None or (status not in TERMINAL and not target.phases):
        return None
    delivery = WebhookDelivery(
        id=uuid.uuid4(),
        job_id=job.id,
        event=f"job.{status.value}",
        url=target.url,
        payload={},
        status="pending",
        attempts=0,
    )
    delivery.payload = {
        "event": delivery.event,
        "delivery": str(delivery.id),
        "created_at": utcnow().isoformat(),
        "job": summary(session, job),
    }
    secret_of(tenant)
    session.add(delivery)
    session.flush()
    _send_after_commit(session, delivery.id)
    return delivery


def _send_after_commit(session: Session, delivery_id: uuid.UUID) -> None:
    outbox.send_after_commit(
        session, "webhook delivery", delivery_id, lambda d, i: d.deliver_webhook(i)
    )


# -- delivering ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    done: bool
    retry_in: float | None = None


def _request(delivery: WebhookDelivery, secret: str, settings: Settings) -> int:
    """One signed POST to the delivery's URL; the response status (raises on no answer).

    ``webhook_timeout_seconds`` bounds the whole try, from connecting to the status line
    (``TimeoutError`` past it): httpx's timeouts are per read, so a receiver that sends its
    answer a byte every few seconds had held a worker for the task's whole time limit, every
    other task waiting behind it. The response's body is never read (the status is the
    answer), so a receiver's gigabyte costs no memory."""
    import asyncio

    target = netguard.resolve(delivery.url, netguard.networks(settings.webhook_allow_networks))
    url, headers, extensions = netguard.pinned_request(target)
    body = json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True).encode()
    stamp = int(time.time())
    headers.update(
        {
            "Content-Type": "application/json",
            "User-Agent": "zoopick-webhooks",
            EVENT_HEADER: delivery.event,
            DELIVERY_HEADER: str(delivery.id),
            SIGNATURE_HEADER: f"t={stamp},v1={signature(secret, stamp, body)}",
        }
    )
    timeout = settings.webhook_timeout_seconds
    post = _post(url, body, headers, extensions, timeout)
    return asyncio.run(asyncio.wait_for(post, timeout))


async def _post(
    url: str, body: bytes, headers: dict[str, str], extensions: dict[str, str], timeout: float
) -> int:
    """The POST of :func:`_request`: its status, the body left unread."""
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout) as client:
        request = client.build_request(
            "POST", url, content=body, headers=headers, extensions=extensions
        )
        response = await client.send(request, stream=True)
        await response.aclose()  # the status line and headers are all a webhook answers
        return response.status_code


def deliver(session: Session, delivery_id: uuid.UUID, settings: Settings) -> Outcome:
    """Try the delivery once and log how it went; ``retry_in`` seconds when it should be tried
    again (doubling from ``webhook_backoff_seconds``)."""
    delivery = session.get(WebhookDelivery, delivery_id, with_for_update=True)
    if delivery is None or delivery.status != "pending":
        return Outcome(done=True)
    job = session.get(Job, delivery.job_id)
    tenant = session.get(Tenant, job.tenant_id) if job is not None else None
    if tenant is None:
        return Outcome(done=True)
    delivery.attempts += 1
    retry = True
    try:
        status = _request(delivery, secret_of(tenant), settings)
    except netguard.Refused as exc:
        status, delivery.error, retry = None, f"refused: {exc}", False
    except Exception as exc:  # noqa: BLE001 - any transport failure is the receiver's
        status, delivery.error = None, f"no answer: {type(exc).__name__}: {exc}"[:2000]
    delivery.response_status = status
    if status is not None and 200 <= status < 300:
        delivery.status, delivery.error, delivery.delivered_at = "delivered", None, utcnow()
        return Outcome(done=True)
    if status is not None:
        delivery.error = f"answered {status}"
    if not retry or delivery.attempts >= settings.webhook_max_attempts:
        delivery.status = "failed"
        return Outcome(done=True)
    return Outcome(
        done=False, retry_in=outbox.retry_in(settings.webhook_backoff_seconds, delivery.attempts)
    )


def deliveries(session: Session, job_id: uuid.UUID) -> list[WebhookDelivery]:
    """A job's delivery log, oldest first."""
    return list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.job_id == job_id)
            .order_by(WebhookDelivery.created_at)
        )
    )


def stale_after(settings: Settings) -> float:
    """Seconds after which a pending delivery nobody touched was lost (its task message, or the
    send after its commit): longer than the whole backoff schedule plus one try."""
    return outbox.stale_after(
        settings.webhook_backoff_seconds,
        settings.webhook_max_attempts,
        settings.webhook_timeout_seconds,
    )


def resend_stale(factory: Any, dispatcher: Any, settings: Settings) -> list[str]:
    """Send again the deliveries left pending (the recovery sweep calls this): delivery is at
    least once, and receivers tell repeats apart by the ``Zoopick-Delivery`` id."""
    from datetime import timedelta

    from sqlalchemy import update

    cutoff = utcnow() - timedelta(seconds=stale_after(settings))
    with factory.begin() as session:
        ids = list(
            session.scalars(
                select(WebhookDelivery.id)
                .where(WebhookDelivery.status == "pending", WebhookDelivery.updated_at < cutoff)
                .limit(100)
            )
        )
        if ids:  # touched: the next sweep waits a whole period again
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id.in_(ids))
                .values(updated_at=utcnow())
            )
    for delivery_id in ids:
        dispatcher.deliver_webhook(str(delivery_id))
    return [str(i) for i in ids]
