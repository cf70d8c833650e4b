"""Tenants' secrets: values encrypted in Redis under one key the operator holds.

::

    key = keygen()                                  # riverbed secrets keygen
    store = SecretStore(bus.log_store.redis, bus.keys, settings.secrets_key)
    await store.set("acme", "GITHUB_TOKEN", token)  # riverbed secrets set acme GITHUB_TOKEN < file
    await store.list("acme")                        # [("GITHUB_TOKEN", 1795000000.0)], never values
    await store.get_many("acme", ["GITHUB_TOKEN"])  # {"GITHUB_TOKEN": token}, for a run that names it
    await store.rotate(new_key)                     # every value re-encrypted under new_key

Each tenant's secrets are one Redis hash (``keys.tenant_secrets``): name -> JSON record with the
AES-GCM ``nonce`` and ``ciphertext`` (base64), the ``kid`` of the key (an HMAC of a fixed label
under the key: it names the key without revealing it) and ``set_at`` (unix seconds).  The tenant
and the name are the associated data of the encryption, so a record copied to another tenant or
name does not decrypt.  The key is 32 random bytes in base64 (``RIVERBED_SECRETS_KEY``); without
it every call refuses in one sentence, and a key other than the one the secrets are under is
told apart from an altered record by the ``kid`` (``keys.secrets_key_id`` holds the store's).

A value shorter than :data:`MIN_VALUE_CHARS` is refused: masking it in outputs
(``agent/masking.py``) would eat ordinary text.  Another tenant's secret and a missing one get the
same answer.  ``cryptography`` is imported where it is used, so the client imports this module
without the ``worker`` or ``serve`` extra.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

import msgspec
import structlog

from riverbed import events
from riverbed.agent.masking import Masker
from riverbed.bus import scripts
from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import RedisClient
from riverbed.errors import ConfigError, InputError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "MAX_VALUE_BYTES",
    "MIN_VALUE_CHARS",
    "Rotated",
    "SecretStore",
    "TenantSecrets",
    "check_key",
    "check_name",
    "check_value",
    "keygen",
]

MIN_VALUE_CHARS = 8
"""The shortest value stored: a shorter one, masked in outputs, would eat ordinary text."""
MAX_VALUE_BYTES = 64 * 1024
"""The longest value stored (UTF-8 bytes)."""
_NAME_RE = re.compile(events.SECRET_NAME_PATTERN)
_NO_KEY = (
    "secrets need RIVERBED_SECRETS_KEY (32 random bytes in base64) in the environment of the CLI, "
    "the workers and riverbed serve: `riverbed secrets keygen` prints one"
)
_WRONG_KEY = (
    "the stored secrets are encrypted under another key than RIVERBED_SECRETS_KEY, so nothing was read "
    "or written: set the key they were stored (or last rotated) with"
)
_KID_LABEL = b"riverbed secrets key id"
FRESH_SECONDS = 1.0
"""How old a worker's copy of a tenant's secrets may be before it reads them again."""

log = structlog.get_logger("riverbed.secrets")
E = TypeVar("E", bound=msgspec.Struct)


class Rotated(msgspec.Struct, kw_only=True, frozen=True):
    """What :meth:`SecretStore.rotate` re-encrypted."""

    tenants: int
    secrets: int


class _Record(msgspec.Struct, kw_only=True, frozen=True):
    nonce: str
    ciphertext: str
    kid: str
    set_at: float


def keygen() -> str:
    """A new secrets key: 32 random bytes in base64 (the value of ``RIVERBED_SECRETS_KEY``)."""
    return base64.b64encode(os.urandom(32)).decode()


def check_name(name: str) -> str:
    """``name`` when it is a secret's name (``[A-Z_][A-Z0-9_]*``, like an environment variable)."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InputError(
            f"{name!r} is not a secret name: use up to 128 capital letters, digits and underscores, "
            "not starting with a digit (like GITHUB_TOKEN)"
        )
    return name


def check_value(value: str) -> str:
    """``value`` when it may be stored (at least :data:`MIN_VALUE_CHARS` characters)."""
    if len(value) < MIN_VALUE_CHARS:
        raise InputError(
            f"a secret's value must be at least {MIN_VALUE_CHARS} characters, since masking a shorter "
            "one in outputs would hide ordinary text"
        )
    if value != value.strip():
        raise InputError(
            "a secret's value may not begin or end with spaces or line breaks, since masking looks for the exact value"
        )
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise InputError(f"a secret's value may be at most {MAX_VALUE_BYTES} bytes")
    return value


def check_key(key: str | None) -> None:
    """Refuse (:class:`ConfigError`, one sentence) a missing or malformed ``RIVERBED_SECRETS_KEY``."""
    if not key:
        raise ConfigError(_NO_KEY)
    _parse_key(key, "RIVERBED_SECRETS_KEY")


def _check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not 0 < len(tenant) <= 200:
        raise InputError("a tenant name is 1 to 200 characters")
    return tenant


def _parse_key(key: str, where: str) -> bytes:
    try:
        raw = base64.b64decode(key.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(
            f"{where} must be 32 bytes in base64 (44 characters, as `riverbed secrets keygen` prints), "
            "and the one given is not"
        )
    return raw


def _kid(raw: bytes) -> str:
    return base64.b64encode(hmac.new(raw, _KID_LABEL, hashlib.sha256).digest()[:12]).decode()


def _aad(tenant: str, name: str) -> bytes:
    # Length-prefixed, so no (tenant, name) pair reads as another.
    t = tenant.encode()
    return len(t).to_bytes(4, "big") + t + name.encode()


def _cipher(raw: bytes) -> AESGCM:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: PLC0415  (an extra's)

    return AESGCM(raw)


class _Key:
    """A parsed key, its id and its cipher."""

    def __init__(self, raw: bytes) -> None:
        self.kid = _kid(raw)
        self._aes = _cipher(raw)

    def seal(self, tenant: str, name: str, value: str, set_at: float) -> bytes:
        nonce = os.urandom(12)
        sealed = self._aes.encrypt(nonce, value.encode(), _aad(tenant, name))
        record = _Record(
            nonce=base64.b64encode(nonce).decode(),
            ciphertext=base64.b64encode(sealed).decode(),
            kid=self.kid,
            set_at=set_at,
        )
        return msgspec.json.encode(record)

    def open(self, tenant: str, name: str, record: _Record) -> str:
        from cryptography.exceptions import InvalidTag  # noqa: PLC0415  (an extra's)

        if record.kid != self.kid:
            raise ConfigError(_WRONG_KEY)
        try:
            plain = self._aes.decrypt(
                base64.b64decode(record.nonce), base64.b64decode(record.ciphertext), _aad(tenant, name)
            )
        except (InvalidTag, binascii.Error, ValueError) as exc:
            raise ConfigError(
                f"secret {name} of this tenant does not decrypt: its record was altered or copied from "
                "another tenant or name, so set it again"
            ) from exc
        return plain.decode()


def _record(raw: bytes, name: str) -> _Record:
    try:
        return msgspec.json.decode(raw, type=_Record)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"secret {name} of this tenant is not a readable record, so set it again") from exc


class SecretStore:
    """The tenants' secrets under one key prefix, encrypted under ``key`` (None: every call refuses)."""

    def __init__(self, redis: RedisClient, keys: Keys, key: str | None) -> None:
        self.redis = redis
        self.keys = keys
        self._key = _Key(_parse_key(key, "RIVERBED_SECRETS_KEY")) if key else None
        self._set = redis.script(scripts.SET_SECRET)
        self._rewrite = redis.script(scripts.REWRITE_SECRETS)
        self._remove = redis.script(scripts.REMOVE_SECRET)

    @property
    def has_key(self) -> bool:
        return self._key is not None

    def check_key(self) -> None:
        """Refuse (:class:`ConfigError`, one sentence) when the store has no key."""
        self._need_key()

    def _need_key(self) -> _Key:
        if self._key is None:
            raise ConfigError(_NO_KEY)
        return self._key

    async def set(self, tenant: str, name: str, value: str) -> float:
        """Store ``value`` as ``tenant``'s secret ``name`` (replacing one); when it was set."""
        key = self._need_key()
        _check_tenant(tenant)
        check_name(name)
        check_value(value)
        set_at = round(time.time(), 3)
        record = key.seal(tenant, name, value, set_at)
        done = await self._set(
            [self.keys.tenant_secrets(tenant), self.keys.secret_tenants, self.keys.secrets_key_id],
            [tenant, name, record, key.kid],
        )
        if not int(done):
            raise ConfigError(_WRONG_KEY)
        return set_at

    async def list(self, tenant: str) -> list[tuple[str, float]]:
        """``tenant``'s secrets' names and when each was set, by name (never a value)."""
        key = self._need_key()
        _check_tenant(tenant)
        stored = await self.redis.hgetall(self.keys.tenant_secrets(tenant))
        records = {name.decode(): _record(raw, name.decode()) for name, raw in stored.items()}
        if any(record.kid != key.kid for record in records.values()):
            raise ConfigError(_WRONG_KEY)
        return sorted((name, record.set_at) for name, record in records.items())

    async def remove(self, tenant: str, name: str) -> None:
        """Remove ``tenant``'s secret ``name``; one that is not there is refused (:class:`InputError`)."""
        self._need_key()
        _check_tenant(tenant)
        check_name(name)
        if not int(await self._remove([self.keys.tenant_secrets(tenant)], [name])):
            raise InputError(f"no secret {name} for this tenant")

    async def get_many(self, tenant: str, names: Iterable[str]) -> dict[str, str]:
        """The values of ``tenant``'s secrets ``names``; an unknown name (another tenant's too) is
        refused: ``no secret NAME for this tenant``."""
        key = self._need_key()
        _check_tenant(tenant)
        wanted = list(dict.fromkeys(check_name(name) for name in names))
        if not wanted:
            return {}
        stored = await self.redis.hmget(self.keys.tenant_secrets(tenant), wanted)
        values: dict[str, str] = {}
        for name, raw in zip(wanted, stored, strict=True):
            if raw is None:
                raise InputError(f"no secret {name} for this tenant")
            values[name] = key.open(tenant, name, _record(raw, name))
        return values

    async def get_all(self, tenant: str) -> dict[str, str]:
        """Every secret of ``tenant``, by name (what masking looks for in its sessions' outputs)."""
        key = self._need_key()
        stored = await self.redis.hgetall(self.keys.tenant_secrets(_check_tenant(tenant)))
        return {
            name.decode(): key.open(tenant, name.decode(), _record(raw, name.decode())) for name, raw in stored.items()
        }

    async def missing(self, tenant: str, names: Iterable[str]) -> tuple[str, ...]:
        """Which of ``names`` ``tenant`` has no secret under (read without the key: a run is
        refused before it opens)."""
        wanted = list(dict.fromkeys(check_name(name) for name in names))
        if not wanted:
            return ()
        stored = await self.redis.hmget(self.keys.tenant_secrets(_check_tenant(tenant)), wanted)
        return tuple(name for name, raw in zip(wanted, stored, strict=True) if raw is None)

    async def rotate(self, new_key: str) -> Rotated:
        """Re-encrypt every tenant's secrets under ``new_key``, all or nothing; afterwards only
        ``new_key`` reads them (set it as RIVERBED_SECRETS_KEY everywhere)."""
        old = self._need_key()
        new = _Key(_parse_key(new_key, "the new secrets key"))
        for _attempt in range(5):
            tenants = sorted(t.decode() for t in await self.redis.hgetall(self.keys.secret_tenants))
            hashes = [self.keys.tenant_secrets(t) for t in tenants]
            args: list[str | bytes] = [old.kid, new.kid]
            count = 0
            used = 0
            for index, (tenant, hash_key) in enumerate(zip(tenants, hashes, strict=True)):
                stored = await self.redis.hgetall(hash_key)
                used += bool(stored)
                for raw_name, raw in sorted(stored.items()):
                    name = raw_name.decode()
                    record = _record(raw, name)
                    value = old.open(tenant, name, record)  # a wrong key stops here, nothing written
                    args += [str(index + 2), name, raw, new.seal(tenant, name, value, record.set_at)]
                    count += 1
            rewritten = int(await self._rewrite([self.keys.secrets_key_id, *hashes], args))
            if rewritten == -2:
                raise ConfigError(_WRONG_KEY)
            if rewritten >= 0:
                self._key = new
                return Rotated(tenants=used, secrets=count)
        raise InputError("the secrets kept changing during the rotation, so nothing was rotated: run it again")


class TenantSecrets:
    """One worker's view of its tenants' secrets: the values a session's actions and tools may
    use, and a masker over every value of a tenant for what its sessions append.

    Both read one cache per tenant, refreshed at most every :data:`FRESH_SECONDS`, and at once
    when a name is asked for that the cache does not hold: a value this worker hands out is
    always in the masker it masks with afterwards.  Without a key (``store`` None) nothing is
    handed out and nothing needs masking."""

    def __init__(self, store: SecretStore | None, *, fresh_seconds: float = FRESH_SECONDS) -> None:
        self.store = store if store is not None and store.has_key else None
        self.fresh_seconds = fresh_seconds
        self._cache: dict[str, tuple[float, dict[str, str], Masker | None]] = {}
        self._failed: set[str] = set()

    async def refresh(self, tenant: str | None, *, force: bool = False) -> None:
        """Read ``tenant``'s secrets again when the cache is older than :data:`FRESH_SECONDS`."""
        if self.store is None or tenant is None:
            return
        cached = self._cache.get(tenant)
        now = time.monotonic()
        if cached is not None and not force and now - cached[0] < self.fresh_seconds:
            return
        try:
            values = await self.store.get_all(tenant)
        except (ConfigError, InputError) as exc:
            if tenant not in self._failed:  # (said once per tenant: the operator's to fix)
                self._failed.add(tenant)
                log.error("secrets.unreadable", tenant=tenant, error=str(exc))  # noqa: TRY400  (one sentence)
            values = {}
        masker = (cached[2] if cached is not None and cached[1] == values else Masker(values)) if values else None
        self._cache[tenant] = (now, values, masker)
        if len(self._cache) > 10_000:  # (many tenants: keep the newest)
            self._cache.pop(next(iter(self._cache)))

    def masker(self, tenant: str | None) -> Masker | None:
        """The masker of ``tenant``'s values as last read (None: it has none, or not read yet)."""
        cached = self._cache.get(tenant) if tenant is not None else None
        return cached[2] if cached is not None else None

    def mask_event(self, tenant: str | None, event: E) -> E:
        """``event`` with ``tenant``'s values masked in every string of it."""
        masker = self.masker(tenant)
        return event if masker is None else masker.mask_event(event)

    async def values(self, tenant: str | None, names: Iterable[str]) -> dict[str, str]:
        """The values of ``names`` for ``tenant``'s session; :class:`InputError` for a name it
        has no secret under (another tenant's gets the same answer), :class:`ConfigError` when
        this worker has no key."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        if self.store is None:
            raise ConfigError(f"this worker cannot read secrets ({_NO_KEY})")
        if tenant is None:
            raise InputError(f"secrets belong to a tenant, and this session has none, so {wanted[0]} cannot be used")
        await self.refresh(tenant)
        cached = self._cache[tenant][1]
        if any(name not in cached for name in wanted):
            await self.refresh(tenant, force=True)
            cached = self._cache[tenant][1]
        for name in wanted:
            if name not in cached:
                raise InputError(f"no secret {name} for this tenant")
        return {name: cached[name] for name in wanted}
