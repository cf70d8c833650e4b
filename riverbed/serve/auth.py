"""API keys for the HTTP API: created, listed and revoked by ``riverbed keys``, checked per request.

A key reads ``rbk_<id>_<secret>``: ``id`` (12 hex digits) names it in ``keys list`` and
``keys revoke``; ``secret`` is 256 random bits.  Redis keeps only the sha256 of the whole key,
in one hash (``Keys.api_keys``: id -> JSON record), so checking a request is one ``HGET`` and a
constant-time compare, and a revocation counts from the next request on (nothing is cached).

A key belongs to one tenant and sees only that tenant's sessions; an admin key
(``keys create --admin``) sees every session, for the console's operator views.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import RawClient, RedisClient, as_client
from riverbed.errors import InputError, NotFoundError

__all__ = ["ApiKey", "KeyStore", "Principal", "valid_tenant"]

KEY_PREFIX = "rbk"
_KEY_RE = re.compile(r"rbk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})")
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@=+-]{0,63}")


def valid_tenant(tenant: str) -> str:
    """``tenant`` when it is a valid tenant name, else :class:`InputError` in one sentence."""
    if not _TENANT_RE.fullmatch(tenant):
        raise InputError(
            f"{tenant!r} is not a valid tenant: use up to 64 letters, digits and . _ : @ = + - "
            "(starting with a letter or digit)"
        )
    return tenant


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """What Redis keeps of a key (never the key itself)."""

    id: str
    tenant: str | None
    admin: bool = False
    sha256: str
    created: float
    revoked: float | None = None
    note: str | None = None

    def public(self) -> dict[str, object]:
        """The record as ``keys list`` and the API show it: no hash."""
        return {
            "id": self.id,
            "tenant": self.tenant,
            "admin": self.admin,
            "created": self.created,
            "revoked": self.revoked,
            "note": self.note,
        }


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: a tenant's key, or an admin key (``tenant`` may then be None)."""

    key_id: str
    tenant: str | None
    admin: bool

    def may_see(self, session_tenant: str | None) -> bool:
        """Whether a session of ``session_tenant`` exists for this key (tenant-less ones: admins only)."""
        return self.admin or (self.tenant is not None and session_tenant == self.tenant)


_decode_record = msgspec.json.Decoder(ApiKey).decode


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    """The API keys under one prefix."""

    def __init__(self, redis: RedisClient | RawClient, keys: Keys, url: str = "redis") -> None:
        self.redis = as_client(redis, url)
        self.key = keys.api_keys

    async def create(self, tenant: str | None, *, admin: bool = False, note: str | None = None) -> tuple[str, ApiKey]:
        """A new key: (the key, printed once and never stored, its record)."""
        if tenant is None and not admin:
            raise InputError("a key needs a tenant (--tenant T), or --admin for an operator key")
        if tenant is not None:
            valid_tenant(tenant)
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(id=key_id, tenant=tenant, admin=admin, sha256=_digest(key), created=time.time(), note=note)
        added = await self.redis.hsetnx(self.key, key_id, msgspec.json.encode(record))
        if not added:  # 48 random bits collided: vanishingly rare, and safe to retry
            return await self.create(tenant, admin=admin, note=note)
        return key, record

    async def list(self) -> list[ApiKey]:
        raw = await self.redis.hgetall(self.key)
        return sorted((_decode_record(v) for v in raw.values()), key=lambda r: r.created)

    async def revoke(self, key_id: str) -> ApiKey:
        """Mark the key revoked (it stays listed); :class:`NotFoundError` for an unknown id."""
        raw = await self.redis.hget(self.key, key_id)
        if raw is None:
            raise NotFoundError(f"no API key {key_id!r} (`riverbed keys list` shows the ids)")
        record = _decode_record(raw)
        if record.revoked is None:
            record = msgspec.structs.replace(record, revoked=time.time())
            await self.redis.hset(self.key, key_id, msgspec.json.encode(record))
        return record

    async def live(self, key_ids: Sequence[str]) -> set[str]:
        """Those of ``key_ids`` that are still valid (neither revoked nor deleted), in one call."""
        raws = await self.redis.hmget(self.key, key_ids)
        return {k for k, raw in zip(key_ids, raws, strict=True) if raw and _decode_record(raw).revoked is None}

    async def check(self, key: str) -> Principal | None:
        """The principal of a presented key; None when it is malformed, unknown or revoked."""
        match = _KEY_RE.fullmatch(key)
        if match is None:
            return None
        raw = await self.redis.hget(self.key, match.group(1))
        if raw is None:
            return None
        record = _decode_record(raw)
        if record.revoked is not None or not hmac.compare_digest(record.sha256, _digest(key)):
            return None
        return Principal(key_id=record.id, tenant=record.tenant, admin=record.admin)
