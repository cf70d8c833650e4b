"""A view as OpenAI chat messages: a pure function, so a prompt can be rebuilt from the log.

Rules, in view order:

- the ``system_prompt`` (if given) comes first;
- the summary becomes a user message saying that earlier events were condensed;
- a ``message`` from the agent is assistant content, from anyone else a user message;
  ``think`` and ``finish`` are assistant content;
- an action that expects an answer is an assistant tool call, immediately followed by its
  observation(s) as the ``tool`` result (observations are pulled forward to their call, as
  the API requires; several observations of one action are joined);
- tool call ids and names, by identity: an action that records the ``tool_call_id`` it
  answers takes that call of its response (its ``cause``; without one, the latest earlier
  response with that call id), id, name and arguments as the model wrote them, and the
  response's content goes with them;
- actions without a ``tool_call_id`` (logs written before it existed) take the response's
  remaining calls in order only when they line up one to one: as many actions (those whose
  ``cause`` is the response, else the agent's actions that follow it up to the next
  response or user message) as calls, each action what its call asks for.  Otherwise, and
  for any other action, the call is synthesised: ``call_rb_<event id>``, the kind as the
  name and the action's fields as JSON arguments.  So a result is never shown under
  another call's id, name or arguments;
- an assistant message with tool calls has string content (empty when the model said
  nothing): strict OpenAI-compatible servers refuse ``null``;
- a tool call without an observation in the view (still running, or forgotten) is left out,
  and so is an observation whose action is not in the view, so the provider never sees an
  unmatched call or result;
- a cause names an earlier event: one that names a later event is treated as naming an event
  not in the view;
- an observation with no cause, or answering something that is not a tool call (a
  workspace recall answering the user's message), becomes a user message;
- other events (``session_config``, ``forked``, ``unknown``, an MCP server's listing:
  ``mcp_list`` and its ``mcp_tools``, which become the request's tools) are not shown;
- images, only when an ``images`` source is given (a vision model): a user ``message``'s
  ``images`` become ``image_url`` parts after its text, and the images a ``python_run`` saved
  (``python_output.files``) follow its batch's tool results as one user message (tool results
  are text only).  An image the source cannot give (missing, too large, outside the
  workspace) is a text part saying so.  Without a source, a message's images are named in
  its text as left out.

Apply ``riverbed.memory.condensers.prepare`` first when the session masks observations.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any, NamedTuple

from riverbed.agent.images import ImageSource, is_image
from riverbed.agent.tools import action_from_call, tool_names
from riverbed.errors import InputError
from riverbed.events import (
    Action,
    Error,
    Event,
    FileContent,
    Finish,
    LlmResponse,
    McpList,
    McpTools,
    Message,
    Observation,
    PythonOutput,
    Think,
)
from riverbed.memory.tokens import action_arguments, event_text
from riverbed.memory.view import Masked, Summary

__all__ = [
    "CACHE_MODES",
    "SUMMARY_PREFIX",
    "Mark",
    "cache_breakpoints",
    "convert",
    "shown_by_tools",
    "starts_turn",
    "to_messages",
    "tool_call_id",
    "tool_name",
]

ChatMessage = dict[str, Any]

SUMMARY_PREFIX = "Earlier events were condensed to save context. Summary of them:\n"

_NAME_RE = re.compile(r"[^a-zA-Z0-9_-]")


def tool_call_id(event_id: int) -> str:
    """The tool call id of an action that no recorded model response names."""
    return f"call_rb_{event_id}"


def tool_name(kind: str) -> str:
    """An event kind as a function name the API accepts."""
    return _NAME_RE.sub("_", kind)[:64] or "action"


def _cause(event: Event) -> int | None:
    """``event.cause`` when it names an earlier event, else -1 (no event's id): an event cannot
    answer, or be caused by, one that comes after it, so such a cause names an event not in the
    view."""
    cause = event.cause
    return cause if cause is None or event.id is None or cause < event.id else -1


def _answerable(event: Event) -> bool:
    return isinstance(event, Action) and event.answered_by is not None and event.id is not None


# What the conversion does with an event, by its class (looked up once per class, not tested
# with a chain of isinstance per event: most of the conversion's CPU on long views).
_OTHER, _SUMMARY, _MESSAGE, _SAID, _RESPONSE, _CALL, _RESULT = range(7)
_ROLES: dict[type, int] = {}
_ANSWERABLE: dict[type, bool] = {}
"""Whether the class is an action that expects an observation (:func:`_answerable` but for the id)."""


def _role(cls: type) -> int:
    role = _ROLES.get(cls)
    if role is None:
        if issubclass(cls, Summary):
            role = _SUMMARY
        elif issubclass(cls, Message):
            role = _MESSAGE
        elif issubclass(cls, Think | Finish):
            role = _SAID
        elif issubclass(cls, LlmResponse):
            role = _RESPONSE
        elif issubclass(cls, Action) and cls.answered_by is not None:
            role = _CALL
        elif issubclass(cls, Observation):
            role = _RESULT
        else:
            role = _OTHER
        _ANSWERABLE[cls] = issubclass(cls, Action) and cls.answered_by is not None
        _ROLES[cls] = role
    return role


def _learn(events: list[Event]) -> None:
    """Read the role of each class among ``events`` that no conversion has met yet, so that the
    passes over them look their classes up without a test."""
    for cls in set(map(type, events)).difference(_ROLES):
        _role(cls)


_READERS: dict[type, Callable[[Any], str]] = {
    **dict.fromkeys((Message, Summary, Masked, FileContent), attrgetter("content")),
    Think: attrgetter("thought"),
}
""":func:`event_text` of an event of one of these very classes (not of a subclass), read
without matching the event against each kind in turn."""


def _text(event: Event) -> str:
    read = _READERS.get(type(event))
    return read(event) if read is not None else event_text(event)


_MAPPINGS = (dict, Mapping)
"""(a dict is tested first: the ABC's check costs much more)"""
_UNANSWERED_TOOLS = frozenset(tool_name(kind) for kind in ("think", "finish", "message"))
_KNOWN_TOOLS = frozenset(tool_names())
_NONE: frozenset[str] = frozenset()
_LISTINGS = (McpList, McpTools)
"""An MCP server's listings: the request's tools show them (:func:`shown_by_tools`)."""


def _call_name(raw: Mapping[str, Any]) -> str | None:
    function = raw.get("function")
    name = function.get("name") if isinstance(function, _MAPPINGS) else None
    return name if isinstance(name, str) else None


def _normalise_call(raw: Mapping[str, Any], action_id: int) -> dict[str, Any] | None:
    """A recorded tool call in wire form (shown for the action ``action_id``), or None when it
    cannot be used."""
    function = raw.get("function")
    if not isinstance(function, _MAPPINGS) or not isinstance(name := function.get("name"), str):
        return None
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = raw.get("id")
    return {
        "id": call_id if isinstance(call_id, str) and call_id else tool_call_id(action_id),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _lines_up(action: Event, raw: Mapping[str, Any]) -> bool:
    """Whether ``action`` is what the recorded call asks for (a call to a tool this agent does
    not know cannot be checked, and counts as lining up)."""
    name = _call_name(raw)
    if name not in _KNOWN_TOOLS:
        return True
    arguments = raw["function"].get("arguments", "{}")
    try:
        asked = action_from_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments))
    except InputError:
        return False
    return asked.kind == action.kind and action_arguments(asked) == action_arguments(action)


class _Scan(NamedTuple):
    """What the conversion needs to know before it emits the first message."""

    by_id: dict[int, Event]
    results: dict[int, list[Observation]]
    """the observations answering each action that expects them, by the action's id"""
    spoken: set[int | None]
    """the causes of what the agent said (a response whose words were said apart)"""
    calls: dict[int, dict[str, Any]]
    """recorded tool calls in wire form, by the id of the action each goes with (the actions
    some response claims)"""
    claimed_by: dict[int, list[int]]
    """the actions each llm_response claims, by its id"""


def _scan(events: list[Event]) -> _Scan:
    """One pass over ``events`` (their classes learned): the facts of :class:`_Scan`.

    Tool calls are claimed first by identity: an action that records ``tool_call_id`` takes
    that call of the response it names as ``cause`` (without a cause: of the latest earlier
    response with that call).  The rest go by :func:`_claim_by_position`.
    """
    roles, answerable = _ROLES, _ANSWERABLE
    by_id: dict[int, Event] = {}
    results: dict[int, list[Observation]] = {}
    spoken: set[int | None] = set()
    calls: dict[int, dict[str, Any]] = {}
    claimed_by: dict[int, list[int]] = {}
    responses: dict[int, LlmResponse] = {}
    order: list[int] = []  # (the responses' places)
    taken: dict[int, set[str]] = {}
    latest: dict[str, int] = {}  # call id -> the latest of the responses order[:indexed] to make it
    indexed = 0
    caused: dict[int, list[Event]] = {}
    for position, e in enumerate(events):
        role = roles[type(e)]
        eid = e.id
        if role == _CALL:
            if eid is not None:
                cause = e.cause
                if cause is not None and cause >= eid:
                    cause = -1  # (as _cause reads it)
                call_id = e.tool_call_id  # type: ignore[attr-defined]
                if isinstance(call_id, str):
                    if cause is None:
                        while indexed < len(order):  # (read only for an action without a cause)
                            response = events[order[indexed]]
                            indexed += 1
                            for recorded in response.tool_calls:  # type: ignore[attr-defined]
                                if isinstance(recorded, _MAPPINGS) and isinstance(named := recorded.get("id"), str):
                                    latest[named] = response.id  # type: ignore[assignment]
                        owner = latest.get(call_id)
                    else:
                        owner = cause if cause in responses else None
                    if owner is not None:
                        owner_taken = taken.get(owner)
                        if owner_taken is None:
                            owner_taken = taken[owner] = set()
                        if call_id not in owner_taken:
                            for raw in responses[owner].tool_calls:  # (the first call with that id)
                                if isinstance(raw, _MAPPINGS) and raw.get("id") == call_id:
                                    call = _normalise_call(raw, eid)
                                    break
                            else:
                                call = None
                            if call is not None:
                                calls[eid] = call
                                owner_taken.add(call_id)
                                claimed_by.setdefault(owner, []).append(eid)
                                by_id[eid] = e
                                continue
                if cause in responses:
                    caused.setdefault(cause, []).append(e)
        elif role == _RESULT:
            cause = e.cause
            if cause is not None:
                if eid is not None and cause >= eid:
                    cause = -1
                action = by_id.get(cause)  # (an earlier event: folded already)
                if action is not None and answerable[type(action)]:
                    answers = results.get(cause)
                    if answers is None:
                        results[cause] = [e]  # type: ignore[list-item]
                    else:
                        answers.append(e)  # type: ignore[arg-type]
        elif role == _RESPONSE:
            if eid is not None:
                responses[eid] = e  # type: ignore[assignment]
                order.append(position)
        elif role in (_SAID, _MESSAGE) and e.source == "agent":
            spoken.add(_cause(e))
        if eid is not None:
            by_id[eid] = e
    if order:
        _claim_by_position(events, order, calls, claimed_by, taken, caused, one_each=len(order) == len(responses))
    return _Scan(by_id, results, spoken, calls, claimed_by)


def _claim_by_position(
    events: list[Event],
    order: list[int],
    calls: dict[int, dict[str, Any]],
    claimed_by: dict[int, list[int]],
    taken: dict[int, set[str]],
    caused: dict[int, list[Event]],
    *,
    one_each: bool,
) -> None:
    """Claim the calls of the responses (at the places ``order``) that no action took by id
    (``taken``: the call ids each took; ``one_each``: no two responses have the same id).

    For actions without the id (logs written before it existed), by position: the
    response's remaining calls go to its remaining actions only when they line up one to
    one (as many actions as calls, each action what its call asks for); otherwise every one
    of those actions is shown under a synthesised call.
    """
    for position in order:
        response: LlmResponse = events[position]  # type: ignore[assignment]
        assert response.id is not None
        # Calls that publish no answered action (think, finish) take no position among the claimants.
        used = taken.get(response.id, _NONE)
        if one_each and len(used) == len(response.tool_calls):
            continue  # (each call went to its action by id, for its ids are as many as its calls)
        answered_calls = [
            raw
            for raw in response.tool_calls
            if isinstance(raw, _MAPPINGS) and _call_name(raw) not in _UNANSWERED_TOOLS and raw.get("id") not in used
        ]
        if not answered_calls:
            continue  # (every call went to its action by id: nothing is left to line up)
        claimants = caused.get(response.id)
        if claimants is None:
            claimants = []
            for index in range(position + 1, len(events)):
                e = events[index]
                if starts_turn(e):
                    break
                if _answerable(e) and e.source == "agent" and _cause(e) is None and e.id not in calls:
                    claimants.append(e)
        claimants = [e for e in claimants if not isinstance(getattr(e, "tool_call_id", None), str)]
        if not claimants or len(claimants) != len(answered_calls):
            continue
        if not all(_lines_up(a, raw) for a, raw in zip(claimants, answered_calls, strict=True)):
            continue
        ids = claimed_by.setdefault(response.id, [])
        for action, raw in zip(claimants, answered_calls, strict=True):
            assert action.id is not None
            call = _normalise_call(raw, action.id)
            if call is not None and action.id not in calls:
                calls[action.id] = call
                ids.append(action.id)
        ids.sort()


_TOOL_NAMES: dict[type, str] = {}
""":func:`tool_name` of each class's kind, as synthesised calls name it"""


def _synthesised_call(action: Event) -> dict[str, Any]:
    assert action.id is not None
    name = _TOOL_NAMES.get(type(action))
    if name is None:
        name = _TOOL_NAMES[type(action)] = tool_name(action.kind)
    return {
        "id": tool_call_id(action.id),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(action_arguments(action))},
    }


def _result_text(observations: list[Observation]) -> str:
    if len(observations) == 1:
        obs = observations[0]
        text = _text(obs)
        return f"error: {text}" if isinstance(obs, Error) else text
    parts = []
    for obs in observations:
        text = _text(obs)
        parts.append(f"error: {text}" if isinstance(obs, Error) else text)
    return "\n".join(parts)


def _image_parts(refs: Iterable[str], images: ImageSource) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for ref in refs:
        url = images(ref)
        if url is None:
            parts.append({"type": "text", "text": f"[image {ref} left out: missing, too large or not readable]"})
        else:
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _message(e: Message, images: ImageSource | None) -> ChatMessage:
    role = "assistant" if e.source == "agent" else "user"
    refs = e.images if isinstance(e.images, list) else []
    if not refs:
        return {"role": role, "content": e.content}
    if images is None or role != "user":
        names = ", ".join(refs)
        return {"role": role, "content": f"{e.content}\n[images not shown to this model: {names}]"}
    return {"role": role, "content": [{"type": "text", "text": e.content}, *_image_parts(refs, images)]}


def to_messages(
    view: Iterable[Event], *, system_prompt: str | None = None, images: ImageSource | None = None
) -> list[ChatMessage]:
    """OpenAI chat messages for a view (see the module docstring for the rules)."""
    out: list[ChatMessage] = []
    if system_prompt:
        out.append({"role": "system", "content": system_prompt})
    events = list(view)
    listings = {cls for cls in set(map(type, events)) if issubclass(cls, _LISTINGS)}
    if listings:
        events = [e for e in events if type(e) not in listings]
    convert(events, out, set(), images=images)
    return out


def shown_by_tools(event: Event) -> bool:
    """An MCP server's listing, which the request's tools show (never a message)."""
    return isinstance(event, _LISTINGS)


def starts_turn(event: Event) -> bool:
    """Whether ``event`` ends the actions a response before it can claim by position (a later
    response, or a message from anyone but the agent)."""
    role = _role(type(event))
    return role == _RESPONSE or (role == _MESSAGE and event.source != "agent")


Mark = tuple[int, int, int]
"""A place where :func:`convert` could start again: the event's index, the messages and the
tool call ids used before it."""


def convert(
    events: list[Event],
    out: list[ChatMessage],
    used_ids: set[str],
    *,
    images: ImageSource | None = None,
    added: list[str] | None = None,
    marks: list[Mark] | None = None,
) -> None:
    """Append the messages of ``events`` (a view without MCP listings) to ``out``.

    ``used_ids``: the tool call ids the messages before them use (each id is used once);
    ``added`` collects the ids used here, in order.  ``marks`` collects, before each event that
    starts a turn (:func:`starts_turn`), where the conversion could start again: a caller that
    keeps the messages of a growing view converts again only from the last such place that no
    later event refers back across (:class:`riverbed.agent.prompt.Prompt`)."""
    _learn(events)
    roles, answerable = _ROLES, _ANSWERABLE
    by_id, results, spoken, calls, claimed_by = _scan(events)

    def emit_calls(content: str | None, action_ids: list[int]) -> None:
        tool_calls = []
        answers: list[ChatMessage] = []
        readers = _READERS
        for action_id in action_ids:
            observations = results.get(action_id)
            if observations is None:
                continue
            call = calls.get(action_id) or _synthesised_call(by_id[action_id])
            call_id = call["id"]
            if call_id in used_ids:
                call_id = tool_call_id(action_id)
                call = {**call, "id": call_id}
            used_ids.add(call_id)
            if added is not None:
                added.append(call_id)
            tool_calls.append(call)
            if len(observations) == 1:  # (_result_text's own path, inline: one call less per result)
                obs = observations[0]
                read = readers.get(type(obs))
                text = read(obs) if read is not None else event_text(obs)
                if isinstance(obs, Error):
                    text = f"error: {text}"
            else:
                text = _result_text(observations)
            answers.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if not tool_calls:
            if content:
                out.append({"role": "assistant", "content": content})
            return
        # Content is a string even when empty: strict OpenAI-compatible servers refuse null.
        out.append({"role": "assistant", "content": content or "", "tool_calls": tool_calls})
        out.extend(answers)
        if images is None:
            return
        saved: list[tuple[int, list[str]]] = []
        for action_id in action_ids:
            for obs in results.get(action_id, ()):
                files = [f for f in obs.files if is_image(f)] if isinstance(obs, PythonOutput) else []
                if files and obs.id is not None:
                    saved.append((obs.id, files))
        if saved:
            parts: list[dict[str, Any]] = []
            for obs_id, files in saved:
                parts.append({"type": "text", "text": f"Images saved by the Python cell (event {obs_id}):"})
                parts.extend(_image_parts(files, images))
            out.append({"role": "user", "content": parts})

    for index, e in enumerate(events):
        role = roles[type(e)]
        if marks is not None and (role == _RESPONSE or (role == _MESSAGE and e.source != "agent")):
            marks.append((index, len(out), len(added) if added is not None else 0))  # (starts_turn)
        if role == _CALL:
            eid = e.id
            if eid is not None and eid not in calls:  # (a claimed action is shown with its response)
                emit_calls(None, [eid])
        elif role == _RESULT:
            cause = e.cause
            if cause is not None:
                eid = e.id
                if eid is not None and cause >= eid:
                    cause = -1
                action = by_id.get(cause)
                if action is None or answerable[type(action)]:
                    continue
            out.append({"role": "user", "content": f"[{e.kind}]\n{_result_text([e])}"})  # type: ignore[list-item]
        elif role == _RESPONSE:
            eid = e.id
            content = None if eid in spoken else e.content  # type: ignore[attr-defined]
            emit_calls(content, claimed_by.get(eid, []) if eid is not None else [])
        elif role == _SAID:
            text = _text(e)
            if text:
                out.append({"role": "assistant" if e.source == "agent" else "user", "content": text})
        elif role == _MESSAGE:
            out.append(_message(e, images))  # type: ignore[arg-type]
        elif role == _SUMMARY:
            out.append({"role": "user", "content": SUMMARY_PREFIX + e.content})  # type: ignore[attr-defined]


CACHE_MODES = ("none", "anthropic")
"""Values of ``RIVERBED_PROMPT_CACHE``."""

_EPHEMERAL = {"type": "ephemeral"}


def _marked(message: ChatMessage) -> ChatMessage:
    content = message.get("content")
    if isinstance(content, str):
        if not content:
            return message  # an empty text part is refused by some providers: no breakpoint here
        parts: list[dict[str, Any]] = [{"type": "text", "text": content}]
    elif isinstance(content, list) and content:
        parts = [dict(part) for part in content]
    else:
        return message
    parts[-1] = {**parts[-1], "cache_control": _EPHEMERAL}
    return {**message, "content": parts}


def cache_breakpoints(messages: list[ChatMessage], mode: str = "anthropic") -> list[ChatMessage]:
    """The messages with prompt-cache breakpoints for providers that want them marked.

    ``anthropic`` (Anthropic, and OpenAI-compatible proxies that pass ``cache_control``
    through): the content of the system message and of the last message become text parts,
    the last part with ``cache_control: {"type": "ephemeral"}``.  The system breakpoint
    caches the tools and the system prompt; the moving one at the end lets the next step
    read this whole prompt from the cache (it only appends to it).  ``none``: unchanged
    (OpenAI caches prefixes without being told).  The text is the same either way, so the
    prompt's prefix stays identical between steps.
    """
    if mode == "none" or not messages:
        return messages
    if mode != "anthropic":
        raise InputError(f"unknown prompt cache mode {mode!r}: use {' or '.join(CACHE_MODES)}")
    out = list(messages)
    if out[0].get("role") == "system":
        out[0] = _marked(out[0])
    if len(out) > 1:
        out[-1] = _marked(out[-1])
    return out
