"""Errors as HTTP responses: RFC 9457 problem documents, translated once, here.

Every error a client sees is ``application/problem+json`` with ``type``, ``title``,
``status`` and ``detail`` (one sentence saying what happened and what to do), plus a few
extension members where they help a program (``last`` on an append conflict, ``retryable``).

==========================  ======  ============================================================
error                       status  when
==========================  ======  ============================================================
HTTPException               its own a route's own refusal: 401 no or bad key, 413, 415, 429, 404 path
InputError (DecodeError)    400     bad JSON, kind, field, bound, session id
AlreadyAnswered             409     a second answer to an action
AppendConflict              409     ``expected_last`` did not match
IdempotencyKeyReused        409     an ``Idempotency-Key`` sent again with another body
FencedError                 409     (not reachable through the API: it appends with no fence)
NotFoundError               404     no such session for this key (or another tenant's)
QuotaExceeded               429     the tenant is at a quota (``Retry-After`` when its daily tokens are)
TenantMismatch              404     an append to another tenant's session: it is not there for this key
ActTimeout                  504     no observation within the act timeout
UnavailableError            503     Redis or Postgres unreachable
ServiceError                503     an embedded service failed
ConfigError, other errors   500     the detail says what to fix; never a traceback
==========================  ======  ============================================================
"""

from __future__ import annotations

import math
from http import HTTPStatus

import msgspec
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from riverbed.errors import (
    ActTimeout,
    AlreadyAnswered,
    AppendConflict,
    FencedError,
    IdempotencyKeyReused,
    InputError,
    NotFoundError,
    QuotaExceeded,
    RiverbedError,
    ServiceError,
    TenantMismatch,
    UnavailableError,
)

__all__ = ["PROBLEM_TYPE", "from_exception", "problem"]

PROBLEM_TYPE = "application/problem+json"
log = structlog.get_logger("riverbed.serve")


def problem(
    status: int, detail: str, *, headers: dict[str, str] | None = None, extra: dict[str, object] | None = None
) -> Response:
    """A problem document response (``extra``: extension members)."""
    body = {"type": "about:blank", "title": HTTPStatus(status).phrase, "status": status, "detail": detail}
    body.update(extra or {})
    return Response(msgspec.json.encode(body), status_code=status, media_type=PROBLEM_TYPE, headers=headers)


def _status(exc: RiverbedError) -> int:
    if isinstance(exc, AlreadyAnswered | AppendConflict | FencedError | IdempotencyKeyReused):
        return 409
    if isinstance(exc, InputError):
        return 400
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, QuotaExceeded):
        return 429
    if isinstance(exc, ActTimeout):
        return 504
    if isinstance(exc, UnavailableError | ServiceError):
        return 503
    return 500


def from_exception(request: Request, exc: BaseException) -> Response:
    """The problem document for any exception a route raised (the exception handler)."""
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return from_exception(request, exc.exceptions[0])
    if isinstance(exc, HTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return problem(exc.status_code, detail, headers=dict(exc.headers or {}))
    if isinstance(exc, TenantMismatch):
        # the same answer as a session that does not exist: a stranger learns nothing
        return problem(404, f"there is no session {exc.session!r} for this key", extra={"retryable": False})
    if isinstance(exc, RiverbedError):
        extra: dict[str, object] = {"retryable": exc.retryable}
        if isinstance(exc, AppendConflict):
            extra["last"] = exc.actual
        if isinstance(exc, AlreadyAnswered):
            extra["existing"] = exc.existing
        status = _status(exc)
        if status >= 500:
            log.warning("serve.error", path=request.url.path, status=status, error=str(exc))
        headers = None
        if isinstance(exc, QuotaExceeded) and exc.retry_after is not None:
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return problem(status, str(exc), headers=headers, extra=extra)
    log.error("serve.unexpected", path=request.url.path, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return problem(500, "the server failed unexpectedly; its log has the details")
