"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: it can reach the
database and the broker, and the workers that were seen still beat; with the ray training
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


def _database(request: Request) -> tuple[str | None, str]:
    """(database problem, worker summary): the workers' heartbeats are read in the same
    session (``zoopick.service.liveness``)."""
    from zoopick.service.liveness import worker_status

    try:
        with request.app.state.sessionmaker() as session:
            session.execute(text("SELECT 1"))
            workers = worker_status(session, request.app.state.settings)
    except Exception as exc:  # noqa: BLE001
        return f"database unreachable: {type(exc).__name__}", "unknown"
    problem = workers.problem()
    return None, problem or workers.summary()


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"description": "Not ready (problem details name what is down)"}},
    summary="Readiness",
)
async def readyz(request: Request) -> JSONResponse:
    db, workers = await run_in_threadpool(_database, request)
    broker = await run_in_threadpool(request.app.state.dispatcher.broker_problem)
    stalled = workers if workers.startswith("no live worker") else None
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
            checks=checks,
        )
    return JSONResponse({"status": "ok", "checks": checks})
