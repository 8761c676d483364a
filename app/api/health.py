"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: it can reach the
database and the broker, a worker has been seen and one still beats; with the ray training
backend, ``checks.ray`` says whether the cluster answers)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from zoopick.app.api.schemas import Health
from zoopick.training.backends import ray_address_problem

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz() -> Health:
    return Health(status="ok")


def _database(request: Request) -> tuple[str | None, str | None, str]:
    """(database problem, worker problem, worker summary): the workers' heartbeats are read in
    the same session (``zoopick.service.liveness``). No worker seen yet, or none beating
    lately, is not ready: work would only queue."""
    from zoopick.service.liveness import worker_status

    try:
        with request.app.state.sessionmaker() as session:
            session.execute(text("SELECT 1"))
            workers = worker_status(session, request.app.state.settings)
    except Exception as exc:  # noqa: BLE001
        return f"database unreachable: {type(exc).__name__}", None, "unknown"
    return None, workers.problem(), workers.summary()


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"description": "Not ready (problem details name what is down)"}},
    summary="Readiness",
)
async def readyz(request: Request) -> JSONResponse:
    db, stalled, workers = await run_in_threadpool(_database, request)
    broker = await run_in_threadpool(request.app.state.dispatcher.broker_problem)
    checks = {"database": db or "ok", "broker": broker or "ok", "workers": workers}
    settings = request.app.state.settings
    if settings.train_backend == "ray":
        # reported, not fatal: scoring and the API go on while the GPU pool is away
        ray = await run_in_threadpool(ray_address_problem, settings.ray_address)
        checks["ray"] = ray or f"ok ({settings.ray_address})"
    if db or broker or stalled:
        from zoopick.app.problems import problem_response

        return problem_response(
            request,
            503,
            "; ".join(p for p in (db, broker, stalled) if p),
            kind="not-ready",
            # as every route answers during an outage: when to look again
            headers={"Retry-After": str(settings.retry_after_seconds)},
            checks=checks,
        )
    return JSONResponse({"status": "ok", "checks": checks})
