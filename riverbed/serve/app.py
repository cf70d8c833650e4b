"""The ASGI app (Starlette) and the server that runs it (uvicorn), inside structured concurrency.

::

    async with riverbed.connect(url) as bus:
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve, Api(bus), "127.0.0.1", 8300)

:func:`create_app` does no I/O: the caller connects the bus first, so a Redis that cannot be
reached is one clear error before anything listens.  :func:`serve` binds the socket itself
(port 0 picks a free one and ``task_status`` reports it), runs uvicorn shielded from
cancellation, and stops it the graceful way (``should_exit``) when its scope is cancelled
or on SIGINT/SIGTERM: open event streams end at once, other requests get
:data:`GRACE_SECONDS` to finish.
"""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import msgspec
import structlog
import uvicorn
from anyio.abc import TaskStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from riverbed.errors import ConfigError, RiverbedError
from riverbed.serve import openapi, runs, secrets
from riverbed.serve.problems import from_exception, problem
from riverbed.serve.routes import Api, handlers

__all__ = ["create_app", "serve"]

log = structlog.get_logger("riverbed.serve")

STATIC = Path(__file__).parent / "static"
GRACE_SECONDS = 5.0
STARTUP_SECONDS = 30.0
READY_TIMEOUT = 2.0

_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
_CONSOLE_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


class _Headers:
    """Security headers on every response; a strict content security policy on the console."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        console = not scope["path"].startswith(("/v1/", "/openapi.json", "/healthz", "/readyz"))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + _SECURITY_HEADERS
                if console:
                    headers.append((b"content-security-policy", _CONSOLE_CSP))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _healthz(_request: Request) -> Response:
    return Response(b'{"alive":true}', media_type="application/json")


async def _readyz(request: Request) -> Response:
    bus = request.app.state.api.bus
    try:
        with anyio.fail_after(READY_TIMEOUT):
            await bus.client.ping()
    except Exception as exc:  # any failure means not ready, said in one sentence
        return problem(503, f"Redis does not answer: {exc or type(exc).__name__}")
    return Response(b'{"ready":true}', media_type="application/json")


def _openapi(document: bytes) -> Route:
    async def openapi_json(_request: Request) -> Response:
        return Response(document, media_type="application/json")

    return Route("/openapi.json", openapi_json, methods=["GET"])


async def _console(_request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


async def _not_found(request: Request, _exc: Exception) -> Response:
    return problem(404, f"there is nothing at {request.url.path}; /openapi.json lists the API")


async def _method_not_allowed(request: Request, _exc: Exception) -> Response:
    return problem(405, f"{request.method} is not allowed on {request.url.path}; /openapi.json lists the API")


async def _handle(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException) and exc.status_code == 404 and exc.detail == "Not Found":
        return await _not_found(request, exc)
    if isinstance(exc, HTTPException) and exc.status_code == 405 and exc.detail == "Method Not Allowed":
        return await _method_not_allowed(request, exc)
    return from_exception(request, exc)


def create_app(api: Api) -> Starlette:
    """The whole HTTP surface: ``/v1`` API, ``/openapi.json``, probes and the console at ``/``."""
    routes = [
        *(
            Route(path, handler, methods=methods)
            for path, handler, methods in [*handlers(), *runs.handlers(), *secrets.handlers()]
        ),
        _openapi(msgspec.json.encode(openapi.document())),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", _readyz, methods=["GET"]),
        Route("/", _console, methods=["GET"]),
        Mount("/console", StaticFiles(directory=STATIC), name="console"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_Headers)],
        exception_handlers={
            HTTPException: _handle,
            RiverbedError: _handle,
            ExceptionGroup: _handle,
            Exception: _handle,
        },
    )
    app.state.api = api
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it has started and telling the API when it starts
    shutting down (a signal or ``should_exit``, seen on uvicorn's 0.1 s tick)."""

    def __init__(self, config: uvicorn.Config, api: Api) -> None:
        super().__init__(config)
        self.api = api
        self.ready = anyio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.ready.set()

    async def on_tick(self, counter: int) -> bool:
        stop = await super().on_tick(counter)
        if stop:
            self.api.stopping.set()
        return stop


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: any free port), or one clear :class:`ConfigError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); check --host") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port (0 picks a free one)"
        ) from exc
    sock.setblocking(False)
    return sock


async def serve(
    api: Api, host: str = "127.0.0.1", port: int = 8300, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Serve the app on ``host:port`` until cancelled or signalled; ``task_status`` gets the port."""
    sock = bind(host, port)
    bound = int(sock.getsockname()[1])
    config = uvicorn.Config(
        create_app(api),
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(GRACE_SECONDS),
        timeout_keep_alive=5,
        server_header=False,
    )
    server = _Server(config, api)
    done = anyio.Event()

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):  # stopped through should_exit, never cut off mid-request
                await server.serve(sockets=[sock])
        finally:
            sock.close()
            done.set()

    async with anyio.create_task_group() as tg:
        await tg.start(api.run)  # the followed sessions' readers and the revocation check
        tg.start_soon(run)
        try:
            with anyio.fail_after(STARTUP_SECONDS), anyio.CancelScope() as waiting:
                tg.start_soon(_cancel_when, done, waiting)
                await server.ready.wait()
                waiting.cancel()
            if not server.ready.is_set():
                raise ConfigError(f"the HTTP server on {host}:{bound} did not start; its log says why")
            log.info("serve.listening", host=host, port=bound)
            task_status.started(bound)
            await done.wait()
        finally:
            server.should_exit = True
            api.stopping.set()
        tg.cancel_scope.cancel()  # (api.run runs until cancelled)


async def _cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
