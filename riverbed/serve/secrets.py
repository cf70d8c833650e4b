"""The ``/v1/secrets`` routes: a tenant's key stores, lists and removes its tenant's secrets.

``PUT /v1/secrets/{name}`` takes the value as the body (text, or ``{"value": "..."}`` as JSON);
``GET /v1/secrets`` lists names and when each was set, never values; ``DELETE`` removes one.
The tenant is the key's (an admin key names one with ``?tenant=``).  No route ever answers a
value: runs name the secrets they use and the workers read them (``riverbed.agent.secrets``).
Without ``RIVERBED_SECRETS_KEY`` on the server every route answers 503 in one sentence.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from riverbed.agent.secrets import SecretStore
from riverbed.errors import ConfigError, InputError, NotFoundError
from riverbed.serve.auth import Principal
from riverbed.serve.routes import _api, _body, _json, bounded, principal

__all__ = ["handlers", "list_secrets", "put_secret", "remove_secret"]


class _ValueBody(msgspec.Struct, forbid_unknown_fields=True):
    value: str


def _tenant(request: Request, who: Principal) -> str:
    named = request.query_params.get("tenant") or None
    if who.admin and who.tenant is None:
        if named is None:
            raise InputError("an admin key names the tenant whose secrets it means: add ?tenant=T")
        return named
    if named is not None and named != who.tenant:
        raise InputError("a tenant's key reaches only its own tenant's secrets: leave out the tenant parameter")
    assert who.tenant is not None
    return who.tenant


def _store(request: Request) -> SecretStore:
    api = _api(request)
    try:
        return SecretStore(api.bus.client, api.bus.keys, api.config.secrets_key)
    except ConfigError as exc:
        raise HTTPException(503, str(exc)) from exc


def _keyed(store: SecretStore) -> SecretStore:
    """``store`` when the server has a key; 503 in one sentence when it has none."""
    try:
        store.check_key()
    except ConfigError as exc:
        raise HTTPException(503, str(exc)) from exc
    return store


@bounded
async def put_secret(request: Request) -> Response:
    """Store the key's tenant's secret ``name`` (200): the body is the value."""
    who = await principal(request)
    store = _keyed(_store(request))
    tenant = _tenant(request, who)
    name = request.path_params["name"]
    raw = await _body(request)
    value: Any
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            value = msgspec.json.decode(raw, type=_ValueBody).value
        except msgspec.DecodeError as exc:
            raise InputError(f'a JSON secret body must be {{"value": "..."}} ({exc})') from exc
    else:
        try:
            value = raw.decode()
            value = value[:-1] if value.endswith("\n") else value  # a file's last line break
            value = value[:-1] if value.endswith("\r") else value
        except UnicodeDecodeError as exc:
            raise InputError("a secret's value must be UTF-8 text") from exc
    set_at = await store.set(tenant, name, value)
    return _json({"name": name, "tenant": tenant, "set_at": set_at})


@bounded
async def list_secrets(request: Request) -> Response:
    """The key's tenant's secrets: names and when each was set, never values."""
    who = await principal(request)
    store = _keyed(_store(request))
    tenant = _tenant(request, who)
    rows = await store.list(tenant)
    return _json({"tenant": tenant, "secrets": [{"name": name, "set_at": set_at} for name, set_at in rows]})


@bounded
async def remove_secret(request: Request) -> Response:
    """Remove the key's tenant's secret ``name`` (204; 404 when it has none of that name)."""
    who = await principal(request)
    store = _keyed(_store(request))
    tenant = _tenant(request, who)
    try:
        await store.remove(tenant, request.path_params["name"])
    except InputError as exc:
        if str(exc).startswith("no secret "):
            raise NotFoundError(str(exc)) from exc
        raise
    return Response(status_code=204)


def handlers() -> list[tuple[str, Any, list[str]]]:
    """(path, handler, methods) of the secrets routes."""
    return [
        ("/v1/secrets", list_secrets, ["GET"]),
        ("/v1/secrets/{name}", put_secret, ["PUT"]),
        ("/v1/secrets/{name}", remove_secret, ["DELETE"]),
    ]
