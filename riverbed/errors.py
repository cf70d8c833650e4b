"""riverbed's exceptions: one tree, each error saying what happened and what to do.

::

    RiverbedError                     base; ``retryable`` says whether trying again may help
    ├── ConfigError                   bad configuration (an env var, a flag, a URL)
    ├── InputError                    bad input from a user or agent (JSON, kind, field)
    ├── UnavailableError  (retryable) Redis, Postgres or the embedder cannot be reached
    ├── AppendConflict                ``expected_last`` did not match the log's last id
    ├── FencedError                   a stale owner tried to append (its lease was taken)
    ├── ActTimeout        (retryable) no observation arrived within the timeout
    ├── NotFoundError                 a session or a dead letter does not exist
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


class InputError(RiverbedError):
    """An input (JSON, event kind, field, path) is not acceptable."""


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

    def __init__(self, session: str, role: str, token: int, current: int) -> None:
        super().__init__(
            f"append to session {session!r} refused: this {role} worker's lease (token {token}) "
            f"was taken over (current token {current})"
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
