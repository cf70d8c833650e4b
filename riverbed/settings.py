"""Settings: one frozen Struct loaded from the environment.

==============================  ===============================================================
variable                        meaning
==============================  ===============================================================
RIVERBED_REDIS_URL              Redis URL (``redis://``, ``rediss://``, ``unix://``); unset: the
                                embedded services started by ``riverbed services up`` (or on demand)
RIVERBED_DATABASE_URL           Postgres URL (pgvector needed); unset: the embedded Postgres
RIVERBED_PREFIX                 key namespace in Redis and schema prefix in Postgres (default ``rb``)
RIVERBED_WORKSPACE              sandbox root; one directory per session below it
RIVERBED_SANDBOX                ``namespaces`` (default: bubblewrap, see the README's security model)
                                or ``process`` (no isolation, for machines without user namespaces)
RIVERBED_SANDBOX_NETWORK        ``none`` (default), ``outbound`` (internet, not this host) or ``host``
                                (the worker's own network: unsafe)
RIVERBED_SERVICES_DIR           where ``riverbed services`` keeps embedded data
RIVERBED_EMBEDDER               ``local`` (default, offline MiniLM) or ``openai:<model>``
RIVERBED_LLM_MODEL              chat model for the LLM agent and LLM condensers
RIVERBED_LEASE_SECONDS          ownership lease; a dead owner's sessions move after this
RIVERBED_CONCURRENCY            sessions a worker owns at most (per role)
RIVERBED_REDIS_CONNECTIONS      connections a worker's commands share per Redis node (default 12)
RIVERBED_DRAIN_SECONDS          how long SIGTERM waits for in-flight work
RIVERBED_MAX_ATTEMPTS           deliveries before an entry is dead-lettered
RIVERBED_METRICS_PORT           port of a worker's /metrics, /healthz, /readyz (0: off)
RIVERBED_RETENTION_SECONDS      memory workers archive events older than this to Postgres and trim
                                them from Redis (0, the default: off; needs RIVERBED_DATABASE_URL)
RIVERBED_RETENTION_KEEP_LAST    events retention always leaves in Redis per session (default 1000)
RIVERBED_LOG_FORMAT             ``json`` or ``console`` (default: console on a terminal)
RIVERBED_MAX_EVENT_BYTES        the largest event a user or agent may append, in bytes of its
                                msgpack payload (default 4 MiB; at least 1 KiB); a larger one is
                                refused before anything is written
RIVERBED_PRICES                 price table of ``riverbed usage``: JSON, USD per million tokens per
                                model, e.g. ``{"gpt-4o-mini": {"prompt": 0.15, "cached": 0.075,
                                "completion": 0.6}}`` (``"*"``: any other model)
RIVERBED_SUGGEST_MODEL          model of ``riverbed context SESSION suggest`` (default: RIVERBED_LLM_MODEL;
                                may be a cheaper one)
RIVERBED_PROMPT_CACHE           ``none`` (default; OpenAI caches prompt prefixes by itself) or ``anthropic``:
                                ``cache_control`` breakpoints on the system message and the last message
RIVERBED_LLM_VISION             ``0`` (default: images are not sent), ``1`` (the LLM agent's model sees
                                images) or a comma-separated list of the models that see images
RIVERBED_MAX_IMAGE_BYTES        largest image file sent to a model (default 5 MiB); larger ones are left out
RIVERBED_AGENT_LLM_TIMEOUT      seconds one model call of the agent role may take (default 120)
RIVERBED_AGENT_LLM_RETRY_SECONDS  how long the agent role retries a model server that is down or
                                answers 5xx/429, backing off, before the run ends with ``llm_error``
                                (default 60)
OPENAI_API_KEY                  key for OpenAI or any compatible server
OPENAI_BASE_URL                 base URL of an OpenAI-compatible server
==============================  ===============================================================
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import msgspec

from riverbed.errors import ConfigError

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")


DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024


def default_services_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"riverbed-{os.getuid()}" / "services"


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    redis_url: str | None = None
    database_url: str | None = None
    prefix: str = "rb"
    workspace: str = str(Path(tempfile.gettempdir()) / f"riverbed-{os.getuid()}" / "workspace")
    services_dir: str = str(default_services_dir())
    sandbox: str = "namespaces"
    sandbox_network: str = "none"
    embedder: str = "local"
    llm_model: str = "gpt-4o-mini"
    lease_seconds: float = 5.0
    concurrency: int = 100
    redis_connections: int = 12
    drain_seconds: float = 10.0
    max_attempts: int = 3
    metrics_port: int = 0
    retention_seconds: float = 0
    retention_keep_last: int = 1000
    log_format: str | None = None
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    openai_api_key: str | None = None
    openai_base_url: str | None = None
    prices: str | None = None
    suggest_model: str | None = None
    prompt_cache: str = "none"
    llm_vision: str = "0"
    max_image_bytes: int = 5 * 1024 * 1024
    agent_llm_timeout: float = 120.0
    agent_llm_retry_seconds: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``RIVERBED_*`` (and ``OPENAI_*``) variables; raise :class:`ConfigError` on bad values."""
        env = os.environ if env is None else env
        raw: dict[str, object] = {}
        for field in cls.__struct_fields__:
            name = field.upper() if field.startswith("openai_") else f"RIVERBED_{field.upper()}"
            value = env.get(name)
            if value is not None and value != "":
                raw[field] = value
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            settings = msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad configuration: {_explain(exc)}") from exc
        settings.validate()
        return settings

    @property
    def model_configured(self) -> bool:
        """Whether a model server is configured (``OPENAI_BASE_URL`` or ``OPENAI_API_KEY``)."""
        return bool(self.openai_api_key or self.openai_base_url)

    def validate(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ConfigError(
                f"RIVERBED_PREFIX={self.prefix!r} is not valid: use 1-31 lowercase letters, "
                "digits or underscores, starting with a letter"
            )
        for name, url, schemes in (
            ("RIVERBED_REDIS_URL", self.redis_url, ("redis://", "rediss://", "unix://")),
            ("RIVERBED_DATABASE_URL", self.database_url, ("postgres://", "postgresql://")),
        ):
            if url is not None and not url.startswith(schemes):
                raise ConfigError(f"{name}={url!r} is not a valid URL: it must start with {' or '.join(schemes)}")
        if self.lease_seconds <= 0.2:
            raise ConfigError("RIVERBED_LEASE_SECONDS must be greater than 0.2")
        if self.concurrency < 1:
            raise ConfigError("RIVERBED_CONCURRENCY must be at least 1")
        if self.redis_connections < 4:
            raise ConfigError("RIVERBED_REDIS_CONNECTIONS must be at least 4")
        if self.max_attempts < 1:
            raise ConfigError("RIVERBED_MAX_ATTEMPTS must be at least 1")
        if not self.retention_seconds >= 0:
            raise ConfigError("RIVERBED_RETENTION_SECONDS must be 0 (off) or a number of seconds")
        if self.max_event_bytes < 1024:
            raise ConfigError("RIVERBED_MAX_EVENT_BYTES must be at least 1024 (bytes)")
        if self.retention_keep_last < 1:
            raise ConfigError("RIVERBED_RETENTION_KEEP_LAST must be at least 1")
        if self.sandbox not in ("namespaces", "process"):
            raise ConfigError(f"RIVERBED_SANDBOX={self.sandbox!r} is not valid: use 'namespaces' or 'process'")
        if self.sandbox_network not in ("none", "outbound", "host"):
            raise ConfigError(
                f"RIVERBED_SANDBOX_NETWORK={self.sandbox_network!r} is not valid: use 'none', 'outbound' or 'host'"
            )
        if not self.agent_llm_timeout > 0:
            raise ConfigError("RIVERBED_AGENT_LLM_TIMEOUT must be a number of seconds greater than 0")
        if not self.agent_llm_retry_seconds >= 0:
            raise ConfigError("RIVERBED_AGENT_LLM_RETRY_SECONDS must be 0 (no retry) or a number of seconds")
        if self.max_image_bytes < 1:
            raise ConfigError("RIVERBED_MAX_IMAGE_BYTES must be at least 1")
        if self.prompt_cache not in ("none", "anthropic"):
            raise ConfigError(f"RIVERBED_PROMPT_CACHE={self.prompt_cache!r} is not valid: use 'none' or 'anthropic'")
        if not (self.embedder == "local" or self.embedder.startswith("openai:")):
            raise ConfigError(f"RIVERBED_EMBEDDER={self.embedder!r} is not valid: use 'local' or 'openai:<model>'")


def _explain(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    match = re.search(r"at `\$\.(\w+)`", text)
    if match:
        field = match.group(1)
        var = field.upper() if field.startswith("openai_") else f"RIVERBED_{field.upper()}"
        return f"{var} has an invalid value ({text.split(' - at', maxsplit=1)[0]})"
    return text
