"""riverbed's exceptions: one tree, each error saying what happened and what to do.

::

    RiverbedError                     base; ``retryable`` says whether trying again may help
    ├── ConfigError                   bad configuration (an env var, a flag, a URL)
    │   └── SandboxUnavailable        namespaces sandboxes cannot be built here (runtime.sandbox)
    ├── InputError                    bad input from a user or agent (JSON, kind, field)
    │   ├── DecodeError               a payload is not a valid event (bytes, JSON, a field's value)
    │   ├── AlreadyAnswered           an answer to an action that already has its one answer
    │   ├── TenantMismatch            an append names another tenant than the session's own
    │   ├── SystemEventRefused        a client appended an event only riverbed itself writes
    │   ├── IdempotencyKeyReused      an idempotency key used again with another request
    │   └── PathRefused               a path leads out of a workspace or is not usable (``reason``)
    ├── UnavailableError  (retryable) Redis, Postgres or the embedder cannot be reached
    ├── AppendConflict                ``expected_last`` did not match the log's last id
    ├── FencedError                   a stale owner tried to append (its lease was taken)
    ├── ActTimeout        (retryable) no observation arrived within the timeout
    ├── NotFoundError                 a session or a dead letter does not exist
    ├── QuotaExceeded     (retryable) a tenant is at a quota the operator set (runs, tokens a day)
    ├── ServiceError                  an embedded service failed to start or stop
    └── StorageError                  the database refused a statement (not its connection)
        └── DataError                 a value it cannot hold (SQLSTATE class 22 or 54)

Third-party exceptions are translated at the adapter boundary with ``raise … from exc``.
"""

from __future__ import annotations


class RiverbedError(Exception):
    """Base of every riverbed error."""

    retryable: bool = False


class ConfigError(RiverbedError):
    """The configuration is wrong; the message names the setting and how to fix it."""


REDIS_MIN_VERSION = (7, 0)
"""The oldest Redis riverbed runs on (the append script publishes with ``SPUBLISH``, Redis 7.0):
an older server is a :class:`ConfigError` at connect, an older ``redis-server`` binary a
:class:`ServiceError` when the embedded services start."""


class InputError(RiverbedError):
    """An input (JSON, event kind, field, path) is not acceptable."""


class DecodeError(InputError, ValueError):
    """A payload is not a valid event: bad bytes, bad JSON, an unknown field, a value out of
    the bounds the schema states (also a ``ValueError``, as it was before it joined the tree)."""


class AlreadyAnswered(InputError):
    """An answer to action ``cause`` was refused: event ``existing`` already answers it.

    ``Log.append`` *returns* it (a worker whose answer lost a race just acknowledges the
    entry, without an exception on its hot path); the client API raises it.
    """

    def __init__(self, cause: int, existing: int, message: str | None = None) -> None:
        super().__init__(message or f"action {cause} is already answered by event {existing}")
        self.cause = cause
        self.existing = existing

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AlreadyAnswered):
            return NotImplemented
        return (self.cause, self.existing) == (other.cause, other.existing)

    def __hash__(self) -> int:
        return hash((self.cause, self.existing))


class SystemEventRefused(InputError):
    """A client (the HTTP API, ``riverbed append``/``act``, a handle acting for a tenant)
    appended an event that only riverbed itself writes: ``forked``, ``sandbox_rebuilt``, a
    role's observation, or a kind with a ``source`` it does not take from clients
    (``riverbed.events.check_client``).  Nothing of the batch is appended."""


class TenantMismatch(InputError):
    """An append named another tenant than the one the session's first append fixed.

    A session without a tenant is pinned too: an append naming any tenant is refused, and so
    is an append naming none onto a tenant's session.  Nothing of the refused batch is appended.
    """

    def __init__(self, session: str, tenant: str | None) -> None:
        # The message does not name the session's tenant: the caller may be a stranger.
        super().__init__(
            f"append to session {session!r} refused: it does not belong to "
            f"{'tenant ' + repr(tenant) if tenant else 'sessions without a tenant'}; "
            "open the session with the tenant it was created with"
        )
        self.session = session
        self.tenant = tenant


class IdempotencyKeyReused(InputError):
    """An idempotency key bound to one request (the HTTP API binds it to a hash of the body)
    came again with another: nothing was appended, and the first request's ids stand."""

    def __init__(self, session: str, first: int) -> None:
        super().__init__(
            f"append to session {session!r} refused: this idempotency key was used for another request "
            f"(the one that appended from event {first}); use a new key for a new request"
        )
        self.session = session
        self.first = first


class QuotaExceeded(RiverbedError):
    """A tenant is at one of its quotas (``riverbed tenants set``): no run opens for it now.
    ``retry_after``: seconds until the quota has room again, when that is known."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UnavailableError(RiverbedError):
    """A backing service cannot be reached right now."""

    retryable = True


class AppendConflict(RiverbedError):
    """The log moved since the writer last read it (optimistic concurrency)."""

    def __init__(self, session: str, expected: int, actual: int) -> None:
        super().__init__(
            f"append to session {session!r} refused: expected the last event id to be "
            f"{expected} but it is {actual}; re-read the log and try again"
        )
        self.session = session
        self.expected = expected
        self.actual = actual


class FencedError(RiverbedError):
    """The writer's fencing token is stale: another worker owns the session now."""

    def __init__(self, session: str, role: str, token: int, current: int | None = None) -> None:
        """``current``: the session's token now, when the refusal said it (None: not known)."""
        now = f" (current token {current})" if current is not None else ""
        super().__init__(
            f"append to session {session!r} refused: this {role} worker's lease (token {token}) was taken over{now}"
        )
        self.session = session
        self.role = role
        self.token = token
        self.current = current


class ActTimeout(RiverbedError):
    """No observation answered an action in time."""

    retryable = True


class NotFoundError(RiverbedError):
    """The thing asked for does not exist."""


class PathRefused(InputError):
    """A path names something outside the workspace, or is not a usable path.

    ``reason`` is the ``error`` observation's reason (``path_outside_workspace``,
    ``symlink_refused``, ``hard_link_refused``, ``bad_path``, ``not_found`` …): an agent
    can act on it, and none of them goes away by trying again.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ServiceError(RiverbedError):
    """An embedded service (redis-server, Postgres) failed to start or stop."""


class StorageError(RiverbedError):
    """The database refused a statement for a reason other than its connection: a schema or
    permission problem an operator has to look at.  Trying the same statement again does
    not help, so a worker counts it against the entry (and dead-letters after the attempts)."""


class DataError(StorageError):
    """A value the database cannot hold (Postgres SQLSTATE class 22 ``data_exception``, such
    as a NUL byte in text, or class 54 ``program_limit_exceeded``): the entry's fault.

    ``event_ids`` names the events whose values they are, when the writer knows them.
    """

    def __init__(self, message: str, *, event_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.event_ids = event_ids
