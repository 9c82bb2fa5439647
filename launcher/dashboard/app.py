"""The dashboard's routes: two pages (the runs, one run), the JSON they poll, the stacks button's POST, and
/metrics. Every handler reads the records anew (launcher.dashboard.data); blocking reads run in Starlette's
thread pool (plain `def` handlers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from launcher.dashboard import data
from launcher.dashboard.guard import Guard
from launcher.errors import MgpuError, RunNotFound

STATIC = Path(__file__).parent / "static"


def _answer(read: Callable[..., object], *args: str) -> JSONResponse:
    """`read(*args)` as JSON; a user-facing error as {"error": paragraph} (404 for no such run)."""
    try:
        return JSONResponse(read(*args))
    except RunNotFound as exc:
        return JSONResponse({"error": str(exc)}, 404)
    except MgpuError as exc:
        return JSONResponse({"error": str(exc)}, 409)


def runs_page(_: Request) -> FileResponse:
    return FileResponse(STATIC / "runs.html")


def run_page(request: Request) -> Response:
    try:
        data.checked(request.path_params["run_id"])
    except RunNotFound as exc:
        return Response(str(exc), 404, media_type="text/plain")
    return FileResponse(STATIC / "run.html")


def api_runs(_: Request) -> JSONResponse:
    return _answer(data.run_list)


def api_run(request: Request) -> JSONResponse:
    return _answer(data.status, request.path_params["run_id"])


def api_series(request: Request) -> JSONResponse:
    return _answer(data.series, request.path_params["run_id"])


def api_logs(request: Request) -> JSONResponse:
    return _answer(data.log_tails, request.path_params["run_id"])


def api_stacks(request: Request) -> JSONResponse:
    return _answer(data.stacks, request.path_params["run_id"])


def metrics(_: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    from launcher.dashboard.metrics import exposition

    return Response(exposition(), media_type=CONTENT_TYPE_LATEST)


def create(token: str, local: bool) -> Starlette:
    """The app; `token`: what every request for data must show; `local`: bound to a loopback address."""
    return Starlette(routes=[
        Route("/", runs_page),
        Route("/runs/{run_id}", run_page),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}", api_run),
        Route("/api/runs/{run_id}/series", api_series),
        Route("/api/runs/{run_id}/logs", api_logs),
        Route("/api/runs/{run_id}/stacks", api_stacks, methods=["POST"]),
        Route("/metrics", metrics),
        Mount("/static", StaticFiles(directory=STATIC)),
    ], middleware=[Middleware(Guard, token=token, local=local)])
