"""Every Redis key riverbed uses, in one place.

All keys of one session share the hash tag ``{<session>}``, so they live in one Redis
Cluster slot and every Lua script touches a single slot.  Keys that are not about one
session (directories, the dead-letter stream, the worker registry) have the prefix as
their own hash tag.

=====================================  =======================================================
key                                    what
=====================================  =======================================================
``{p}:{s}:log``                        the session log (stream; entry id ``<n>-0`` is event n)
``{p}:{s}:meta``                       hash: ``last`` id, ``tenant``, ``created``, ``uid`` (the number of
                                       the session's sandbox user, from ``{p}:{p}:uids``), per role
                                       ``fence:<role>``, ``holder:<role>``, ``expires:<role>``,
                                       ``need:<role>`` (no owner yet: when it was last announced),
                                       ``archived_to`` (events up to it are in the archive),
                                       ``forked`` (the id of the ``forked`` event ``fork()`` wrote)
``{p}:{s}:answers``                    hash: action id -> id of its one answering observation
``{p}:{s}:claims``                     hash: action id -> ``worker:token:nonce`` of the runtime owner
                                       that started it (removed when the action is answered)
``{p}:{s}:run``                        string: the agent role's summary of the session's latest run,
                                       one JSON object (``agent.runs.RunSummary``: ``riverbed runs``;
                                       derived from the log, rewritten each step)
``{p}:{s}:idem:<key>``                 string ``first:count`` for a retried append (with TTL)
``{p}:{s}:wake``                       shard Pub/Sub channel (not a key): the append script publishes
                                       the log's last id on it (``bus/wakeups.py``)
``{p}:{p}:dir:<role>``                 stream: sessions waiting for / held by a role owner (entries ``s``
                                       the session, ``t`` its tenant)
``{p}:{p}:dir:<role>:wait:<t>``        stream: tenant ``t``'s sessions set aside by a worker of the role
                                       while ``t`` held its share there (``bus/lease_loops.py``)
``{p}:{p}:dir:<role>:waiting``         set: the tenants with such a stream
``{p}:{p}:sessions``                   sorted set: every session, scored by creation time
``{p}:{p}:workers``                    sorted set: worker name -> last heartbeat (unix seconds)
``{p}:{p}:uids``                       string: the last sandbox user number handed out (``INCR``)
``{p}:{p}:worker:<name>``              hash: a worker's roles, owned sessions, start time
``{p}:{p}:runs``                        sorted set: sessions that had a run, scored by its opening time
``{p}:{p}:runs:open``                  sorted set: the sessions of ``runs`` whose run is open, same scores
``{p}:{p}:runs:ended``                 sorted set: the sessions of ``runs`` whose run ended, scored by when
                                       it ended (``RIVERBED_RUNS_RETENTION`` trims them from the index)
``{p}:{p}:runs:agents``                hash: session -> the agent its run was opened for (runs that name one)
``{p}:{p}:tenant:<t>:runs``            sorted set: the sessions of ``runs`` of tenant ``t``, same scores
``{p}:{p}:dlq``                        stream: dead letters
``{p}:{p}:retention``                  string: the worker running this round's retention pass
``{p}:{p}:apikeys``                    hash: HTTP API key id -> JSON record (tenant, admin, the
                                       key's sha256, created, revoked); the key itself is never kept
``{p}:{p}:rate:<key id>``              hash: an API key's request token bucket (``tokens``, ``at`` ms)
``{p}:{p}:tenant:<t>:rate``            hash: tenant ``t``'s request token bucket, shared by its keys
``{p}:{p}:tenant:<t>:sessions``        sorted set: the sessions of tenant ``t``, scored by creation
                                       time (written with ``sessions``; a tenant's list reads only it)
``{p}:{p}:tenant-index``               hash: ``done`` once the sessions made before the tenant indexes
                                       existed were added to them (``serve/sessions.py``)
``{p}:{p}:quotas``                     hash: tenant -> its quotas (JSON: ``max_runs``, ``tokens_per_day``),
                                       set by the operator (``riverbed tenants set``)
``{p}:{p}:tenant:<t>:running``         hash: the sessions of tenant ``t`` holding a run slot -> when taken
``{p}:{p}:tenant:<t>:inflight``        hash: the model calls of ``t``'s runs in flight (``<session>:<run>`` ->
                                       ``<estimated tokens> <expiry ms>``), reserved before each call
``{p}:{p}:tenant:<t>:tokens:<day>``    hash: tokens of ``t``'s runs counted on UTC ``day``: per run
                                       (``<session>:<run id>``) its tokens so far, ``_total`` their sum
``{p}:{p}:llm:<model>:<part>``         the model's shared limits (``agent/throttle.py``): ``held`` (zset:
                                       permit -> lease end ms), ``window`` (zset: the last minute's calls),
                                       ``turns`` (zset: tenant -> its turn), ``waiting`` (zset: waiter ->
                                       when it is given up), ``owners`` (hash: waiter -> tenant), ``counts``
                                       (hash: tenant -> its waiters), ``paused`` (string: no permit before
                                       this ms), ``seq`` (string: the last turn handed out)
``{p}:{p}:tenant:<t>:secrets``         hash: the secrets of tenant ``t``: name -> JSON (``nonce`` and
                                       ``ciphertext`` in base64, AES-GCM, ``set_at``; ``agent/secrets.py``)
``{p}:{p}:secret-tenants``             hash: tenant -> ``1`` for every tenant that had a secret (the
                                       tenants ``riverbed secrets rotate`` re-encrypts)
``{p}:{p}:secrets-key``                string: the id of the key the secrets are encrypted under
=====================================  =======================================================
"""

from __future__ import annotations

import functools
import re

from riverbed.errors import InputError

ROLES = ("runtime", "memory", "condenser")
"""The roles that serve every session's log (the agent role serves runs only)."""
ON_DEMAND = ("runtime",)
"""The roles of :data:`ROLES` a session is announced to only by an append of their work (the
runtime role: an action it runs); the others, when the session is created."""
AGENT_ROLE = "agent"
"""The role serving runs: a session is announced to it only when a run opens (``bus/scripts.py``)."""
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@=+-]{0,127}")
PAYLOAD_FIELD = b"e"


def valid_session(session: str) -> bool:
    """Whether ``session`` is a valid id, matched whole (``$`` would let a trailing newline in)."""
    return isinstance(session, str) and _valid_id(session)


@functools.lru_cache(maxsize=8192)
def _valid_id(session: str) -> bool:
    """(Every append checks its session: the ids in use are looked up, not matched again.)"""
    return _SESSION_RE.fullmatch(session) is not None


def directory_entry(session: str, tenant: str | None) -> dict[str, str]:
    """A directory entry's fields: the session (``s``), and its tenant (``t``) when known."""
    return {"s": session} if tenant is None else {"s": session, "t": tenant}


def require_session(session: str) -> str:
    """``session`` when it is a valid session id, else :class:`InputError` in one sentence.

    The id is the key's hash tag, so it may not contain braces: a brace would move the
    session's keys to another Redis Cluster slot than its siblings'.
    """
    if not valid_session(session):
        raise InputError(
            f"{session!r} is not a valid session id: use up to 128 letters, digits and . _ : @ = + - "
            "(starting with a letter or digit)"
        )
    return session


class Keys:
    """Key names under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.dlq = f"{prefix}:{{{prefix}}}:dlq"
        self.sessions = f"{prefix}:{{{prefix}}}:sessions"
        self.workers = f"{prefix}:{{{prefix}}}:workers"
        self.retention = f"{prefix}:{{{prefix}}}:retention"
        self.api_keys = f"{prefix}:{{{prefix}}}:apikeys"
        self.uids = f"{prefix}:{{{prefix}}}:uids"
        self.tenant_index = f"{prefix}:{{{prefix}}}:tenant-index"
        self.runs = f"{prefix}:{{{prefix}}}:runs"
        self.runs_open = f"{prefix}:{{{prefix}}}:runs:open"
        self.runs_ended = f"{prefix}:{{{prefix}}}:runs:ended"
        self.runs_agents = f"{prefix}:{{{prefix}}}:runs:agents"
        self.quotas = f"{prefix}:{{{prefix}}}:quotas"
        self.agents = f"{prefix}:{{{prefix}}}:agents"
        """The agent definitions workers host (a hash: ``<name>@<digest>`` -> JSON, ``agent/registry.py``)."""

    def tenant_running(self, tenant: str) -> str:
        """The sessions of ``tenant`` holding one of its run slots (a hash)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:running"

    def tenant_runs(self, tenant: str) -> str:
        """The sessions of ``tenant`` with a run, scored by when it opened (a sorted set)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:runs"

    def tenant_inflight(self, tenant: str) -> str:
        """The model calls of ``tenant``'s runs in flight, each with its reserved tokens (a hash)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:inflight"

    def tenant_tokens(self, tenant: str, day: str) -> str:
        """The tokens ``tenant``'s runs spent on UTC ``day`` (``YYYY-MM-DD``; a hash)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:tokens:{day}"

    def model_limit(self, model: str, part: str) -> str:
        """One of the keys of ``model``'s shared limits (``part``: ``held``, ``window``, ``turns``,
        ``waiting``, ``owners``, ``counts``, ``paused``, ``seq``)."""
        return f"{self.prefix}:{{{self.prefix}}}:llm:{model}:{part}"

    def tenant_secrets(self, tenant: str) -> str:
        """The encrypted secrets of ``tenant`` (a hash: name -> JSON record)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:secrets"

    @property
    def secret_tenants(self) -> str:
        """The tenants that had a secret (a hash: tenant -> ``1``)."""
        return f"{self.prefix}:{{{self.prefix}}}:secret-tenants"

    @property
    def secrets_key_id(self) -> str:
        """The id of the key every secret is encrypted under (a string; never the key)."""
        return f"{self.prefix}:{{{self.prefix}}}:secrets-key"

    def rate(self, key_id: str) -> str:
        """An HTTP API key's request token bucket."""
        return f"{self.prefix}:{{{self.prefix}}}:rate:{key_id}"

    def tenant_rate(self, tenant: str) -> str:
        """A tenant's HTTP request token bucket (every key of the tenant draws from it)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:rate"

    def tenant_sessions(self, tenant: str) -> str:
        """The sorted set of ``tenant``'s sessions (the sessions index, one tenant's part)."""
        return f"{self.prefix}:{{{self.prefix}}}:tenant:{tenant}:sessions"

    def log(self, session: str) -> str:
        return f"{self.prefix}:{{{session}}}:log"

    def meta(self, session: str) -> str:
        return f"{self.prefix}:{{{session}}}:meta"

    def answers(self, session: str) -> str:
        return f"{self.prefix}:{{{session}}}:answers"

    def claims(self, session: str) -> str:
        return f"{self.prefix}:{{{session}}}:claims"

    def idem(self, session: str, key: str) -> str:
        return f"{self.prefix}:{{{session}}}:idem:{key}"

    def wake(self, session: str) -> str:
        return f"{self.prefix}:{{{session}}}:wake"

    def run(self, session: str) -> str:
        """The agent role's summary of the session's latest run (a string: one JSON ``RunSummary``)."""
        return f"{self.prefix}:{{{session}}}:run"

    def folds(self, session: str) -> str:
        """The roles' saved folds of the session (a hash: role -> saved fold)."""
        return f"{self.prefix}:{{{session}}}:folds"

    def directory(self, role: str) -> str:
        return f"{self.prefix}:{{{self.prefix}}}:dir:{role}"

    def waiting(self, role: str, tenant: str) -> str:
        """Tenant ``tenant``'s directory entries set aside for ``role`` ('' : no tenant)."""
        return f"{self.prefix}:{{{self.prefix}}}:dir:{role}:wait:{tenant}"

    def waiting_tenants(self, role: str) -> str:
        """The tenants with entries set aside for ``role`` (a set)."""
        return f"{self.prefix}:{{{self.prefix}}}:dir:{role}:waiting"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:{{{self.prefix}}}:worker:{name}"

    def session_of(self, log_key: str) -> str:
        start = log_key.index("{") + 1
        return log_key[start : log_key.index("}", start)]
