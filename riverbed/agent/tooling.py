"""Users' Python tools: ``@riverbed.tool`` on a function, its schema, and the one way to call it.

::

    @riverbed.tool
    def count_lines(path: str, ctx: riverbed.ToolContext) -> int:
        \"\"\"How many lines a file of the workspace has.\"\"\"
        ...

    @riverbed.tool(idempotent=True, timeout=10)
    async def lookup(ticket: Annotated[int, Meta(ge=1)]) -> dict[str, str]:
        ...

- The tool's name is the function's name; its description the docstring.
- Its parameters' JSON Schema comes from the annotations through msgspec (``Annotated[...,
  msgspec.Meta(...)]`` for bounds); a parameter annotated :class:`ToolContext` is not part of
  it and receives the call's context.
- :func:`call` checks the arguments against the schema before anything runs (bad arguments:
  an error result and nothing ran), runs the function (a sync one in a thread) within its
  ``timeout``, and turns what it returned into the result's text: a ``str`` as it is, any
  other value as JSON.  ``raise ToolError("…")`` is an error result with that text; any other
  exception is an error result with its type and message.  Nothing a tool does escapes
  :func:`call`: a tool never crashes its worker.

A sync tool that overruns its ``timeout`` is answered at the timeout, but its thread cannot be
stopped: it runs on in the worker until it returns (an async tool is cancelled).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import anyio
import msgspec
import structlog

from riverbed.errors import InputError

__all__ = ["Tool", "ToolContext", "ToolError", "ToolOutcome", "call", "tool"]

DEFAULT_TIMEOUT = 60.0
"""Seconds a tool may run unless its decorator says otherwise."""
MAX_RESULT_CHARS = 200_000
"""A result longer than this is cut (and says so): the log's events have a size limit."""


class ToolError(Exception):
    """Raised by a tool: the model gets this message as an error result."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool learns about the call it serves.

    ``action_id`` is the ``tool_call``'s event id: with the session it names the call once and
    for all, so it is the idempotency key a tool should hand to anything it changes (a tool
    marked ``idempotent`` may be run again with the same key after its worker died)."""

    session: str
    tenant: str | None
    run: int | None
    """the run's ``run_started`` id"""
    action_id: int
    log: Any = field(default=None, repr=False)
    """a structlog logger bound to the session, run and call"""
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def idempotency_key(self) -> str:
        return f"{self.session}:{self.action_id}"

    def secret(self, name: str) -> str:
        """The value of a secret the run may use; :class:`ToolError` when it may not."""
        try:
            return self.secrets[name]
        except KeyError:
            raise ToolError(f"the secret {name!r} is not available to this run") from None


@dataclass(frozen=True)
class ToolOutcome:
    content: str
    is_error: bool = False


@dataclass(frozen=True, eq=False)
class Tool:
    """A Python function offered to a model as a tool (made by :func:`tool`)."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]
    """the JSON Schema of its arguments"""
    arguments_type: type[msgspec.Struct]
    context_parameter: str | None
    idempotent: bool
    timeout: float

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The function itself, so a decorated function can still be called directly."""
        return self.fn(*args, **kwargs)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def where(self) -> str:
        """``module:qualname`` of the function."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    def openai(self) -> dict[str, Any]:
        """The tool as an entry of a chat request's ``tools``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def digest_parts(self) -> dict[str, Any]:
        """What the agent's definition digest covers of this tool: its schema, options and code."""
        try:
            source = inspect.getsource(self.fn)
        except (OSError, TypeError):
            source = self.where
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "idempotent": self.idempotent,
            "timeout": self.timeout,
            "code": hashlib.sha256(source.encode()).hexdigest(),
        }


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(*, idempotent: bool = False, timeout: float = DEFAULT_TIMEOUT) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, idempotent: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a sync or async function a tool (``@tool`` or ``@tool(idempotent=…, timeout=…)``).

    ``idempotent``: running it twice with the same arguments and key does no harm, so a call
    whose worker died while it ran is run again (else it is answered ``tool_lost``).
    ``timeout``: seconds it may run."""
    if fn is not None:
        return _make(fn, idempotent=idempotent, timeout=timeout)
    return functools.partial(_make, idempotent=idempotent, timeout=timeout)


def _make(fn: Callable[..., Any], *, idempotent: bool, timeout: float) -> Tool:
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise InputError(f"@riverbed.tool goes on a function, not on {fn!r}")
    if not timeout > 0:
        raise InputError(f"the timeout of tool {fn.__name__} must be a number of seconds above 0")
    name = fn.__name__
    if not name.replace("_", "a").replace("-", "a").isalnum() or len(name) > 64:
        raise InputError(f"a tool's name must be letters, digits, _ or - (at most 64): {name!r}")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # (a forward reference that does not resolve, ...)
        raise InputError(f"the annotations of tool {name} cannot be read: {exc}") from exc
    fields: list[tuple[str, Any, Any]] = []
    context: str | None = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise InputError(f"tool {name} takes *{param.name}: a tool's parameters must be named ones")
        annotation = hints.get(param.name)
        if annotation is ToolContext:
            context = param.name
            continue
        if annotation is None:
            raise InputError(f"the parameter {param.name!r} of tool {name} has no type annotation")
        if param.default is inspect.Parameter.empty:
            fields.append((param.name, annotation, msgspec.NODEFAULT))
        else:
            fields.append((param.name, annotation, param.default))
    arguments_type = msgspec.defstruct(
        f"{name}_arguments",
        [(n, a) if d is msgspec.NODEFAULT else (n, a, d) for n, a, d in fields],
        kw_only=True,
        forbid_unknown_fields=True,
    )
    try:
        schema = msgspec.json.schema(arguments_type)
    except (TypeError, ValueError) as exc:
        raise InputError(f"tool {name} has a parameter type that has no JSON Schema: {exc}") from exc
    return Tool(
        fn=fn,
        name=name,
        description=inspect.cleandoc(fn.__doc__ or "") or name,
        parameters=_inline(schema),
        arguments_type=arguments_type,
        context_parameter=context,
        idempotent=idempotent,
        timeout=float(timeout),
    )


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """msgspec's schema of the arguments Struct as the object schema itself (``$defs`` of
    nested types kept), with no title a model would read as a field."""
    defs: dict[str, Any] = dict(schema.get("$defs", {}))
    ref = schema.get("$ref", "")
    body = dict(defs.pop(ref.rsplit("/", 1)[-1])) if ref else dict(schema)
    body.pop("title", None)
    body.setdefault("properties", {})
    body["additionalProperties"] = False
    if defs:
        body["$defs"] = defs
    return body


def check_arguments(t: Tool, arguments: Mapping[str, Any]) -> msgspec.Struct:
    """The arguments as the tool's Struct; :class:`InputError` (what is wrong, for the model)."""
    try:
        return msgspec.convert(dict(arguments), t.arguments_type, strict=False)
    except msgspec.ValidationError as exc:
        raise InputError(f"bad arguments for {t.name}: {exc}") from exc


async def call(t: Tool, arguments: Mapping[str, Any], context: ToolContext) -> ToolOutcome:
    """Run ``t`` on ``arguments`` (checked first) for the call ``context`` names; never raises
    for anything the tool does (its errors are error outcomes)."""
    try:
        checked = check_arguments(t, arguments)
    except InputError as exc:
        return ToolOutcome(f"{exc}. The tool did not run; call it again with arguments that fit its schema.", True)
    kwargs = {f: getattr(checked, f) for f in checked.__struct_fields__}
    if t.context_parameter is not None:
        bound = context.log or structlog.get_logger("riverbed.tool")
        kwargs[t.context_parameter] = ToolContext(
            session=context.session,
            tenant=context.tenant,
            run=context.run,
            action_id=context.action_id,
            log=bound.bind(tool=t.name, action=context.action_id),
            secrets=context.secrets,
        )
    try:
        with anyio.fail_after(t.timeout):
            if t.is_async:
                value = await typing.cast(Awaitable[Any], t.fn(**kwargs))
            else:
                value = await anyio.to_thread.run_sync(functools.partial(t.fn, **kwargs), abandon_on_cancel=True)
    except TimeoutError:
        return ToolOutcome(f"the tool {t.name} did not finish within {t.timeout:g} s", True)
    except ToolError as exc:
        return ToolOutcome(str(exc) or f"the tool {t.name} failed", True)
    except Exception as exc:
        return ToolOutcome(f"the tool {t.name} raised {type(exc).__name__}: {exc}", True)
    return ToolOutcome(_text(t, value))


def _text(t: Tool, value: Any) -> str:
    if isinstance(value, str):
        text = value
    else:
        try:
            text = msgspec.json.encode(value).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            return f"[the tool {t.name} returned a value that is not JSON: {exc}]"
    if len(text) > MAX_RESULT_CHARS:
        return text[:MAX_RESULT_CHARS] + f"\n[cut: the result had {len(text)} characters, {MAX_RESULT_CHARS} kept]"
    return text
