"""riverbed: an event-sourced runtime for AI agents on Redis Streams and Postgres + pgvector."""

from riverbed.client.session import Bus, Session, connect
from riverbed.errors import (
    ActTimeout,
    AlreadyAnswered,
    AppendConflict,
    ConfigError,
    DecodeError,
    FencedError,
    IdempotencyKeyReused,
    InputError,
    NotFoundError,
    QuotaExceeded,
    RiverbedError,
    SystemEventRefused,
    TenantMismatch,
    UnavailableError,
)

__all__ = [
    "ActTimeout",
    "AlreadyAnswered",
    "AppendConflict",
    "Bus",
    "ConfigError",
    "DecodeError",
    "FencedError",
    "IdempotencyKeyReused",
    "InputError",
    "NotFoundError",
    "QuotaExceeded",
    "RiverbedError",
    "Session",
    "SystemEventRefused",
    "TenantMismatch",
    "UnavailableError",
    "connect",
]
__version__ = "0.1.0"
