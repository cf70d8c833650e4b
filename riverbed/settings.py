"""Settings: one frozen Struct loaded from the environment, the only reader of ``RIVERBED_*``.

Each field is a variable (``RIVERBED_<FIELD>``; ``openai_*`` fields read ``OPENAI_*``), its
bounds and choices declared in its type (msgspec ``Meta`` and ``Literal``), so a bad value is
one sentence naming the variable and what it takes.  What each one means is the manual's
configuration page (``docs/configuration.md``), which the tests check against these fields.
(``RIVERBED_CRASH_AT`` and ``RIVERBED_PAUSE_AT`` are the fault suite's hooks, read by
``bus/faults.py`` in worker processes under test, and no setting.)
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

from riverbed.errors import ConfigError

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")


DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024
DEFAULT_SANDBOX_TMP_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_EVENTS_PER_APPEND = 10_000


def default_services_dir(environment: str | None = None) -> Path:
    """Where the embedded services of this Python environment (``sys.prefix``: a virtual
    environment, a checkout's ``.venv``) keep their data: one directory per environment, so
    two checkouts never share (or stop) each other's services.  Under the temp directory, since
    the embedded Postgres running as root opens up every ancestor of its data directory."""
    where = environment if environment is not None else sys.prefix
    tag = hashlib.sha256(os.path.realpath(where).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"riverbed-{os.getuid()}" / f"services-{tag}"


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every ``RIVERBED_*`` setting (and ``OPENAI_*``), its bounds and choices in its type: a
    value outside them is one sentence naming the variable (:meth:`from_env`)."""

    redis_url: str | None = None
    database_url: str | None = None
    prefix: Annotated[str, Meta(pattern=_PREFIX_RE.pattern)] = "rb"
    workspace: str = str(Path(tempfile.gettempdir()) / f"riverbed-{os.getuid()}" / "workspace")
    services_dir: str = str(default_services_dir())
    sandbox: Literal["namespaces", "process"] = "namespaces"
    sandbox_network: Literal["none", "outbound", "host"] = "none"
    sandbox_tmp_bytes: Annotated[int, Meta(ge=1024 * 1024)] = DEFAULT_SANDBOX_TMP_BYTES
    sandbox_cpu: Annotated[float, Meta(ge=0.01, le=4096)] = 1.0
    sandbox_memory: Annotated[int, Meta(ge=64 * 1024 * 1024)] = 2 * 1024 * 1024 * 1024
    sandbox_pids: Annotated[int, Meta(ge=16, le=4_194_304)] = 256
    bwrap: str = ""
    mcp_mounts: str = ""
    embedder: Annotated[str, Meta(pattern=r"^(local|openai:.+)$")] = "local"
    recall_timeout: Annotated[float, Meta(ge=0.5, le=3600)] = 8.0
    llm_model: str = "gpt-4o-mini"
    lease_seconds: Annotated[float, Meta(gt=0.2, le=86_400)] = 5.0
    concurrency: Annotated[int, Meta(ge=1, le=1_000_000)] = 100
    tenant_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    redis_connections: Annotated[int, Meta(ge=4)] = 12
    drain_seconds: Annotated[float, Meta(ge=0, le=86_400)] = 10.0
    max_attempts: Annotated[int, Meta(ge=1)] = 3
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    retention_seconds: Annotated[float, Meta(ge=0)] = 0
    retention_keep_last: Annotated[int, Meta(ge=1)] = 1000
    log_format: Literal["json", "console"] | None = None
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    debug: bool = False
    max_event_bytes: Annotated[int, Meta(ge=1024)] = DEFAULT_MAX_EVENT_BYTES
    openai_api_key: str | None = None
    secrets_key: str | None = None
    openai_base_url: str | None = None
    prices: str | None = None
    suggest_model: str | None = None
    prompt_cache: Literal["none", "anthropic"] = "none"
    llm_vision: str = "0"
    max_image_bytes: Annotated[int, Meta(ge=1)] = 5 * 1024 * 1024
    serve_host: str = "127.0.0.1"
    serve_port: Annotated[int, Meta(ge=0, le=65535)] = 8300
    max_events_per_append: Annotated[int, Meta(ge=1)] = DEFAULT_MAX_EVENTS_PER_APPEND
    serve_max_streams_per_key: Annotated[int, Meta(ge=1)] = 500
    serve_max_acts_per_key: Annotated[int, Meta(ge=1)] = 100
    serve_rate: Annotated[float, Meta(ge=0, le=1e9)] = 50.0
    serve_burst: Annotated[int, Meta(ge=1)] = 200
    serve_max_streams_per_tenant: Annotated[int, Meta(ge=1)] = 1000
    serve_max_acts_per_tenant: Annotated[int, Meta(ge=1)] = 200
    serve_tenant_rate: Annotated[float, Meta(ge=0, le=1e9)] = 100.0
    serve_tenant_burst: Annotated[int, Meta(ge=1)] = 400
    runs_retention: Annotated[float, Meta(ge=0)] = 7 * 24 * 3600.0
    llm_timeout: Annotated[float, Meta(gt=0, le=86_400)] = 120.0
    llm_max_output_tokens: Annotated[int, Meta(ge=0, le=1_000_000)] = 4096
    llm_max_response_bytes: Annotated[int, Meta(ge=0)] = 8 * 1024 * 1024
    llm_temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    agent_llm_retry_seconds: Annotated[float, Meta(ge=0, le=86_400)] = 60.0
    agent_max_depth: Annotated[int, Meta(ge=0, le=100)] = 3
    agent_max_fanout: Annotated[int, Meta(ge=0, le=10_000)] = 8
    agent_pace: bool = True
    agent_min_runs: Annotated[int, Meta(ge=1, le=1_000_000)] = 4
    agent_pace_slack: Annotated[float, Meta(ge=1.0, le=100.0)] = 1.2
    agents: str = ""
    agent_max_calls_per_step: Annotated[int, Meta(ge=1, le=10_000)] = 32
    agent_action_timeout: Annotated[float, Meta(ge=0, le=86_400)] = 120.0
    agent_context_recalls: Literal["auto", "on", "off"] = "auto"
    agent_recall_timeout: Annotated[float, Meta(gt=0, le=3_600)] = 15.0
    condenser_strategy: Literal["noop", "recent", "amortized", "masking", "summarizing", "attention"] = "amortized"
    condenser_max_events: Annotated[int, Meta(ge=0)] = 100
    condenser_budget_tokens: Annotated[int, Meta(ge=0)] = 0
    condenser_headroom_tokens: Annotated[int, Meta(ge=0)] = 0
    condenser_keep_first: Annotated[int, Meta(ge=0)] = 1
    condenser_target_ratio: Annotated[float, Meta(gt=0, le=1)] = 0.5
    condenser_mask_window: Annotated[int, Meta(ge=1)] = 10
    condenser_summary_tokens: Annotated[int, Meta(ge=16)] = 1024
    condenser_model: str | None = None
    llm_max_concurrency: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    llm_rpm: Annotated[int, Meta(ge=0, le=100_000_000)] = 0
    llm_context_tokens: Annotated[int, Meta(ge=0, le=100_000_000)] = 0

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, flags: Mapping[str, str] | None = None, **overrides: object
    ) -> Settings:
        """Read ``RIVERBED_*`` (and ``OPENAI_*``) variables, ``overrides`` (a command's flags)
        over them; raise :class:`ConfigError` on bad values, naming the flag (``flags``: the
        flag of each override) when the value came from one."""
        env = os.environ if env is None else env
        raw: dict[str, object] = {}
        for field in cls.__struct_fields__:
            value = env.get(cls.variable(field))
            if value is not None and value != "":
                raw[field] = value
        flagged = {k: v for k, v in overrides.items() if v is not None}
        raw.update(flagged)
        given = dict(raw)
        if isinstance(raw.get("log_level"), str):
            raw["log_level"] = str(raw["log_level"]).lower()
        try:
            settings = msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            named = {field: flag for field, flag in (flags or {}).items() if field in flagged}
            raise ConfigError(_explain(exc, given, named)) from exc
        settings.validate()
        return settings

    @classmethod
    def one(cls, field: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting from the environment, checked as :meth:`from_env` checks it, for a
        place that must not fail on the others (the logging of ``--help``)."""
        env = os.environ if env is None else env
        value = env.get(cls.variable(field))
        if not value:
            return getattr(_DEFAULTS, field)
        raw: dict[str, object] = {field: value.lower() if field == "log_level" else value}
        try:
            return getattr(msgspec.convert(raw, cls, strict=False), field)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(exc, {field: value})) from exc

    @staticmethod
    def variable(field: str) -> str:
        """The environment variable of a field (``OPENAI_*`` keep their own names)."""
        return field.upper() if field.startswith("openai_") else f"RIVERBED_{field.upper()}"

    @property
    def model_configured(self) -> bool:
        """Whether a model server is configured (``OPENAI_BASE_URL`` or ``OPENAI_API_KEY``)."""
        return bool(self.openai_api_key or self.openai_base_url)

    def condenser_defaults(self) -> dict[str, Any]:
        """The condenser config of a session whose ``session_config`` does not say (the fields
        of ``riverbed.memory.condensers.CondenserConfig``; 0 limits are no limit)."""
        defaults: dict[str, Any] = {
            "strategy": self.condenser_strategy,
            "max_events": self.condenser_max_events or None,
            "budget_tokens": self.condenser_budget_tokens or None,
            "headroom_tokens": self.condenser_headroom_tokens,
            "keep_first": self.condenser_keep_first,
            "target_ratio": self.condenser_target_ratio,
            "mask_window": self.condenser_mask_window,
            "summary_tokens": self.condenser_summary_tokens,
            "llm_timeout": self.llm_timeout,
        }
        if self.condenser_model:
            defaults["model"] = self.condenser_model
        return defaults

    def validate(self) -> None:
        """What a type cannot say: the URLs' schemes."""
        for name, url, schemes in (
            ("RIVERBED_REDIS_URL", self.redis_url, ("redis://", "rediss://", "unix://")),
            ("RIVERBED_DATABASE_URL", self.database_url, ("postgres://", "postgresql://")),
        ):
            if url is not None and not url.startswith(schemes):
                raise ConfigError(f"{name}={url!r} is not a valid URL: it must start with {' or '.join(schemes)}")


_DEFAULTS = Settings()

_PREFIX_RULE = "use 1-31 lowercase letters, digits or underscores, starting with a letter"


def _explain(exc: msgspec.ValidationError, raw: Mapping[str, object], flags: Mapping[str, str] | None = None) -> str:
    """One sentence for a value outside its field's type: the variable (or the flag it came
    from), the value and what it takes, read from the declared type (its choices or bounds)."""
    match = re.search(r"at `\$\.(\w+)`", str(exc))
    if match is None:
        return f"bad configuration: {exc}"
    field = match.group(1)
    flag = (flags or {}).get(field)
    shown = f"{Settings.variable(field)}={raw.get(field)!r}"
    if flag is not None:
        shown = f"{flag} {raw.get(field)!r} ({Settings.variable(field)})"
    info = msgspec.inspect.type_info(Settings)
    assert isinstance(info, msgspec.inspect.StructType)
    declared = {f.name: f.type for f in info.fields}[field]
    return f"{shown} is not valid: {_takes(declared, field)}"


def _number(bound: float) -> str:
    """A bound as a reader writes it: 86400, 0.2."""
    return f"{int(bound)}" if float(bound).is_integer() else f"{bound:g}"


def _takes(declared: msgspec.inspect.Type, field: str) -> str:
    """What a field takes, in words."""
    if isinstance(declared, msgspec.inspect.UnionType):
        kinds = [t for t in declared.types if not isinstance(t, msgspec.inspect.NoneType)]
        return _takes(kinds[0], field) if len(kinds) == 1 else "see docs/configuration.md"
    if isinstance(declared, msgspec.inspect.LiteralType):
        choices = [repr(v) for v in declared.values]
        return "use " + (", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0])
    if field == "prefix":
        return _PREFIX_RULE
    if field == "embedder":
        return "use 'local' or 'openai:<model>'"
    if isinstance(declared, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        noun = "a whole number" if isinstance(declared, msgspec.inspect.IntType) else "a number"
        bounds = []
        if declared.ge is not None:
            bounds.append(f"at least {_number(declared.ge)}")
        if declared.gt is not None:
            bounds.append(f"greater than {_number(declared.gt)}")
        if declared.le is not None:
            bounds.append(f"at most {_number(declared.le)}")
        return f"it must be {noun}" + (f", {' and '.join(bounds)}" if bounds else "")
    if isinstance(declared, msgspec.inspect.BoolType):
        return "use 1 or 0 (true or false)"
    return "see docs/configuration.md"
