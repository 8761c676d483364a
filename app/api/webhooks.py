"""``/webhook`` (the tenant's default webhook and its signing secret) and
``/jobs/{job_id}/webhooks`` (a job's delivery log). Sending is the workers' business
(``zoopick.service.webhooks``)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from zoopick.app.api.deps import CallerDep, JobDep, SessionDep, SettingsDep
from zoopick.app.problems import Problem, describe, responses
from zoopick.service import webhooks
from zoopick.service.db.models import Tenant
from zoopick.service.inputs import NoNulModel

router = APIRouter(tags=["webhooks"])


class TenantWebhookIn(NoNulModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str | None = Field(
        description="The default webhook of the tenant's jobs (a job's own `webhook` wins); "
        "null removes it."
    )
    phases: bool = Field(False, description="Also call it on phase changes.")


class TenantWebhookOut(BaseModel):
    url: str | None
    phases: bool
    secret: str = Field(
        description="Key of the `Zoopick-Signature` HMAC (SHA-256 over `<t>.<body>`) of every "
        "webhook of this tenant; keep it on the receiver only."
    )


class DeliveryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    event: str
    url: str
    status: str = Field(description="pending, delivered or failed (after the last try).")
    attempts: int
    response_status: int | None
    error: str | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]


def _out(tenant: Tenant) -> TenantWebhookOut:
    return TenantWebhookOut(
        url=tenant.webhook_url,
        phases=tenant.webhook_phases,
        secret=webhooks.secret_of(tenant),
    )


@router.get("/webhook", response_model=TenantWebhookOut, responses=responses(401))
def get_webhook(session: SessionDep, caller: CallerDep) -> TenantWebhookOut:
    """The tenant's default webhook and signing secret (made on first call)."""
    tenant = session.get(Tenant, caller.tenant_id)
    out = _out(tenant)
    session.commit()
    return out


@router.put("/webhook", response_model=TenantWebhookOut, responses=responses(400, 401, 422))
def put_webhook(
    body: TenantWebhookIn, session: SessionDep, caller: CallerDep, settings: SettingsDep
) -> TenantWebhookOut:
    """Set (or, with ``url: null``, remove) the tenant's default webhook. The URL must resolve
    to an address the server may call (422 naming ``url`` otherwise)."""
    if body.url is not None:
        try:
            webhooks.WebhookOptions(url=body.url, phases=body.phases)
        except ValueError as exc:
            reason = describe(exc.errors()[0]) if hasattr(exc, "errors") else f"url: {exc}"
            raise Problem(422, reason, kind="invalid-webhook") from None
        refused = webhooks.check_url(body.url, settings)
        if refused:
            raise Problem(422, f"url: {refused}", kind="invalid-webhook")
    tenant = session.get(Tenant, caller.tenant_id)
    tenant.webhook_url, tenant.webhook_phases = body.url, body.phases
    out = _out(tenant)
    session.commit()
    return out


@router.get(
    "/jobs/{job_id}/webhooks",
    response_model=list[DeliveryOut],
    responses=responses(401, 404),
    summary="A job's webhook deliveries",
)
def job_deliveries(job: JobDep, session: SessionDep) -> list[DeliveryOut]:
    """Every event of the job sent to its webhook, oldest first, with how delivering it went."""
    return [DeliveryOut.model_validate(d) for d in webhooks.deliveries(session, job.id)]
