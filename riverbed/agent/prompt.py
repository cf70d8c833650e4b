"""A session's prompt kept as its log grows: a step converts only what is new.

:func:`~riverbed.agent.llm.build_messages` and :func:`~riverbed.agent.llm.over_budget` are pure
functions of the log: each call masks and converts the whole context, so a step would cost more
the longer its context.  The agent role keeps a :class:`Prompt` per session instead, which gives
the same answers from what it kept of the step before::

    prompt = Prompt(system=system_prompt(agent), condenser_defaults=defaults)
    prompt.update(seen, builder.view())   # the log so far and its fold (ViewBuilder: incremental)
    prompt.follow(seen, builder)          # the same, reading only the builder's new events
    prompt.over_budget()                  # over_budget(seen, defaults)
    prompt.messages()                     # build_messages(seen, system=..., condenser_defaults=...)
    prompt.encoded("none")                # those messages' JSON array (cache_breakpoints applied)
    prompt.encoded_parts("none")          # the same array's parts, read in place (EncodedMessages)

Between two steps the view only grows at its end, unless a condensation or a context edit came:
then every part below starts again from the first event, once.  Otherwise:

- each masking stage keeps which observations it hides; its boundary moves in steps of half its
  window, so an observation is masked once, and what follows it is converted again then;
- a context recall's rendering is kept with its event;
- the messages are kept with the places where the conversion could start again
  (:func:`~riverbed.agent.messages.convert`'s marks: before each model response and each user
  message).  An update converts again from the last place that no new or changed event refers
  back across (an observation to its action and that action's response, an action to its
  response, the agent's words to the response they speak for): usually the step's own turn;
- the messages' JSON is kept joined, so a request's ``messages`` is that buffer rather than an
  encoding of each message (or of a list of 2,000 encoded parts): the agent role's model client
  writes it to the connection as it is (:class:`EncodedMessages`); a buffer still being sent
  when the prompt changes is left to the request, and the prompt goes on in a copy;
- the condenser's token counts are kept per event.

Nothing here reads the log or the model: it is as pure as the functions it stands for, and a
property test (``tests/test_prompt.py``) checks it against them on random agent-shaped logs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any
from weakref import WeakSet

import msgspec
import structlog

from riverbed import events
from riverbed.agent.images import ImageSource
from riverbed.agent.llm import context_shown
from riverbed.agent.messages import ChatMessage, cache_breakpoints, convert, shown_by_tools
from riverbed.errors import ConfigError
from riverbed.memory.condensers import CondenserConfig, maskable, masked, masked_count
from riverbed.memory.tokens import TokenCounter
from riverbed.memory.view import View, ViewBuilder

__all__ = ["EncodedMessages", "Prompt"]

log = structlog.get_logger("riverbed.agent")

Event = events.Event
_encoder = msgspec.json.Encoder()
_encode, _encode_into = _encoder.encode, _encoder.encode_into


def _unshared(buffer: bytearray) -> bool:
    """Whether no view of ``buffer`` is held (it can grow and shrink: one that is held cannot)."""
    try:
        buffer.append(0)
    except BufferError:
        return False
    del buffer[-1]
    return True


class _Masking:
    """One masking stage (:func:`~riverbed.memory.condensers.mask_observations`) over a list
    that changes only from a known index on: ``out`` is the list as the stage shows it."""

    def __init__(self, config: CondenserConfig) -> None:
        self.config = config
        self.out: list[Event] = []
        self.positions: list[int] = []
        """the input's maskable observations, by index"""
        self.count = 0
        """how many of them (the oldest) are masked"""

    def update(self, given: Sequence[Event], changed: int, pinned: frozenset[int]) -> int:
        """Bring ``out`` up to ``given`` (the last input up to ``changed``); the first index of
        ``out`` that changed."""
        positions, out = self.positions, self.out
        kept = bisect_left(positions, changed)
        del positions[kept:]
        positions.extend(i for i in range(changed, len(given)) if maskable(given[i], pinned))
        before, count = self.count, masked_count(len(positions), self.config)
        self.count = count
        del out[changed:]
        out.extend(given[changed:])
        placeholder = self.config.mask_placeholder
        for i in positions[kept:count]:
            out[i] = masked(given[i], placeholder)
        # The boundary moved among the observations before ``changed``: mask (or show again) those.
        low, high = min(before, count), min(max(before, count), kept)
        for j in range(low, high):
            i = positions[j]
            out[i] = masked(given[i], placeholder) if j < count else given[i]
        return min(changed, positions[low]) if low < high else changed


class _Tally:
    """A forgetting stage's budget over the list at its place in the pipeline
    (:func:`~riverbed.memory.condensers.should_condense`): its events and tokens."""

    def __init__(self, config: CondenserConfig) -> None:
        self.config = config
        self.counter = TokenCounter(config.model, config.tokenizer) if config.token_limit is not None else None
        self.counts: list[int] = []
        self.tokens = 0
        self.size = 0

    def update(self, given: Sequence[Event], changed: int) -> None:
        self.size = len(given)
        if self.counter is None:
            return
        counts = self.counts
        self.tokens -= sum(counts[changed:])
        del counts[changed:]
        count = self.counter.event
        counts.extend(count(e) for e in given[changed:])
        self.tokens += sum(counts[changed:])

    def over(self, summarised: bool) -> bool:
        config = self.config
        if config.max_events is not None and self.size - summarised > config.max_events:
            return True
        limit = config.token_limit
        return limit is not None and self.tokens > limit


class _Context:
    """The context recalls rendered (:func:`~riverbed.agent.llm.context_shown`) and MCP
    listings left out, over a list that changes only from a known index on."""

    def __init__(self) -> None:
        self.out: list[Event] = []
        self.starts: list[int] = []
        """for each input index, the length of ``out`` before it"""
        self.by_id: dict[int, Event] = {}
        self.automatic: set[int] = set()

    def update(self, given: Sequence[Event], changed: int) -> int:
        cut = self.starts[changed] if changed < len(self.starts) else len(self.out)
        out, starts, by_id, automatic = self.out, self.starts, self.by_id, self.automatic
        del out[cut:]
        del starts[changed:]
        for e in given[changed:]:
            starts.append(len(out))
            shown = context_shown(e, by_id, automatic)
            if shown is not None and not shown_by_tools(shown):
                out.append(shown)
            if e.id is not None:
                by_id[e.id] = e
        return cut


class _Messages:
    """The messages of a list of events (:func:`~riverbed.agent.messages.convert`), kept with
    their JSON and the places where converting can start again."""

    def __init__(self, system: str | None, images: ImageSource | None) -> None:
        self.images = images
        self.lent: WeakSet[EncodedMessages] = WeakSet()
        """the :class:`EncodedMessages` that read ``joined`` in place (those still alive)"""
        self.out: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
        self.joined = bytearray()
        """the messages' JSON, each followed by a comma: a request's ``messages`` is this joined
        (no message is encoded again, nor a list of them: msgspec's encoding of 2,000 parts
        cost a step five times its copy of their bytes)"""
        self.ends: list[int] = []
        """where each message's JSON (and its comma) ends in ``joined``"""
        self._encode_from(0)
        self.used: set[str] = set()
        self.added: list[str] = []
        self.marks: list[tuple[int, int, int]] = [(0, len(self.out), 0)]
        """where converting can start again: index, messages before it, ``added`` before it"""
        self.position: dict[int, int] = {}
        """event id -> index"""
        self.root: dict[int, int] = {}
        """an action's id -> the id of the response it may be shown under (its own when none)"""
        self.first_call: dict[str, int] = {}
        """a tool call id -> the first response that made it"""
        self.length = 0
        """the events converted"""

    def _encode_from(self, count: int) -> None:
        """Encode the messages from index ``count`` on, those after it dropped first."""
        for lent in self.lent:  # (each keeps the bytes it reads before they change)
            lent.keep()
        self.lent.clear()
        joined, ends = self.joined, self.ends
        cut = ends[count - 1] if count else 0
        if _unshared(joined):
            del joined[cut:]
        else:
            # A view of it is still held: a request's body still being sent (a transport writes
            # it as it is, ``model_client.request_parts``).  That one keeps the buffer as it was.
            joined = self.joined = bytearray(memoryview(joined)[:cut])
        del ends[count:]
        for message in self.out[count:]:
            _encode_into(message, joined, -1)
            joined += b","
            ends.append(len(joined))

    def _anchor(self, e: Event, i: int) -> int:
        """The first index whose messages ``e`` (at ``i``) may change: where the response is
        that its call or its words (an action: the agent's messages too) or its result go with."""
        position = self.position
        if isinstance(e, events.Action):
            return min(i, position.get(self.root.get(e.id or 0, 0), i))
        if isinstance(e, events.Observation):
            cause = e.cause
            if cause is None or e.id is None or cause >= e.id:
                return i
            # (not the action's response: no place to start again lies between the two)
            return min(i, position.get(cause, i))
        return i

    def _note(self, e: Event, i: int) -> None:
        """Remember where ``e`` is, and which response an action of it may go with."""
        eid = e.id
        if eid is None:
            return
        self.position[eid] = i
        if isinstance(e, events.LlmResponse):
            for call in e.tool_calls:
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if isinstance(call_id, str):
                    self.first_call.setdefault(call_id, eid)
        elif isinstance(e, events.Action):
            cause = e.cause
            if cause is not None and cause < eid:
                self.root[eid] = cause
            elif cause is None and isinstance(e.tool_call_id, str):
                self.root[eid] = self.first_call.get(e.tool_call_id, eid)

    def update(self, given: Sequence[Event], changed: int) -> None:
        if changed >= len(given) == self.length:
            return
        self.length = len(given)
        anchors = [0] * (len(given) - changed)
        for i in range(changed, len(given)):
            e = given[i]
            self._note(e, i)
            anchors[i - changed] = self._anchor(e, i)
        first = min(anchors, default=changed)
        marks = self.marks
        while marks[-1][0] > min(first, changed):
            marks.pop()
        start, count, used_count = marks[-1]
        del self.out[count:]
        for call_id in self.added[used_count:]:
            self.used.discard(call_id)
        del self.added[used_count:]
        found: list[tuple[int, int, int]] = []
        convert(list(given[start:]), self.out, self.used, images=self.images, added=self.added, marks=found)
        self._encode_from(count)
        # A place stays one to start again from while nothing after it refers back across it.
        lowest = len(given)
        valid: set[int] = set()
        for i in range(len(given) - 1, start, -1):
            lowest = min(lowest, anchors[i - changed] if i >= changed else self._anchor(given[i], i))
            if lowest >= i:
                valid.add(i)
        marks.extend((start + at, n, used) for at, n, used in found if at > 0 and start + at in valid)


class Prompt:
    """The prompt of one session's log as it grows (see the module docstring)."""

    def __init__(
        self,
        *,
        system: str | None,
        condenser_defaults: Mapping[str, Any] | None = None,
        images: ImageSource | None = None,
    ) -> None:
        self.system = system
        self.condenser_defaults = dict(condenser_defaults or {})
        self.images = images
        self._scanned = 0
        self._raw: Mapping[str, Any] | None = None
        self.config = self._config()
        self._view: list[Event] = []
        """the view's events, as the stages were last given them"""
        self._source: tuple[ViewBuilder, int, int] | None = None
        """the builder :meth:`follow` read ``_view`` from, its ``changes`` then, and the log events of
        its view then"""
        self._pinned: frozenset[int] = frozenset()
        self._summarised = False
        self._reset()

    def fits(self, system: str | None, condenser_defaults: Mapping[str, Any] | None) -> bool:
        """Whether this prompt is the one of ``system`` and ``condenser_defaults``."""
        return self.system == system and self.condenser_defaults == dict(condenser_defaults or {})

    def _config(self) -> CondenserConfig:
        try:
            return CondenserConfig.from_dict(self._raw, self.condenser_defaults)
        except ConfigError as exc:
            log.warning("agent.bad_condenser_config", error=str(exc))
            return CondenserConfig()

    def _reset(self) -> None:
        self._stages: list[_Masking | _Tally] = [
            _Masking(stage) if stage.strategy == "masking" else _Tally(stage)
            for stage in self.config.flat()
            if stage.strategy == "masking" or stage.forgets
        ]
        self._context = _Context()
        self._messages = _Messages(self.system, self.images)
        self._view = []

    def _configure(self, seen: Sequence[Event]) -> None:
        """Take the condenser settings of the log's new ``session_config`` events, if any."""
        raw = self._raw
        for e in seen[self._scanned :]:
            if isinstance(e, events.SessionConfig) and e.condenser is not None:
                raw = e.condenser
        self._scanned = len(seen)
        if raw is not self._raw:
            self._raw = raw
            config = self._config()
            if config != self.config:
                self.config = config
                self._reset()

    def update(self, seen: Sequence[Event], view: View) -> None:
        """Catch up with the log ``seen`` and its fold ``view`` (both only grow)."""
        self._configure(seen)
        given = view.events
        old = self._view
        changed = len(old)
        if view.pinned != self._pinned or len(given) < changed or list(given[:changed]) != old:
            self._reset()
            changed = 0
        self._view, self._pinned, self._summarised = list(given), view.pinned, view.summary_index is not None
        self._source = None
        self._convert(changed)

    def follow(self, seen: Sequence[Event], builder: ViewBuilder) -> None:
        """:meth:`update` with ``builder``'s view, read only as far as it is new: while the
        builder's view changed only at its end since the last call, its events are not looked
        at again (nor is a view of them made)."""
        self._configure(seen)
        source = self._source
        if (
            source is None
            or source[0] is not builder
            or source[1] != builder.changes
            or not self._view
            or builder.pinned_ids() != self._pinned  # (a pinned unit grew: masking sees it otherwise)
        ):
            view = builder.view()
            self.update(seen, view)
            self._source = (builder, builder.changes, len(view.events) - (view.summary_index is not None))
            return
        new = builder.shown_since(source[2])
        if new:
            changed = len(self._view)
            self._view += new
            self._source = (builder, source[1], source[2] + len(new))
            self._convert(changed)

    def _convert(self, changed: int) -> None:
        """Bring the stages, the context and the messages up to ``self._view``, which changed
        from index ``changed`` on."""
        shown: Sequence[Event] = self._view
        try:
            for stage in self._stages:
                if isinstance(stage, _Masking):
                    changed = stage.update(shown, changed, self._pinned)
                    shown = stage.out
                else:
                    stage.update(shown, changed)
            changed = self._context.update(shown, changed)
            self._messages.update(self._context.out, changed)
        except BaseException:
            self._reset()  # (cut short, the parts disagree: the next update starts again from the first event)
            raise

    def over_budget(self) -> bool:
        """Whether the session's condenser would condense the view now."""
        return any(stage.over(self._summarised) for stage in self._stages if isinstance(stage, _Tally))

    def messages(self) -> list[ChatMessage]:
        """The chat messages (a copy of the list; the messages themselves are shared)."""
        return list(self._messages.out)

    def encoded(self, cache: str = "none") -> msgspec.Raw:
        """The messages' JSON array with :func:`~riverbed.agent.messages.cache_breakpoints`'
        marks for ``cache``: a request's ``messages`` (only the marked ones are encoded again;
        the rest is one copy of the JSON kept)."""
        return msgspec.Raw(self.encoded_parts(cache).join())

    def encoded_parts(self, cache: str = "none") -> EncodedMessages:
        """:meth:`encoded`'s array as the parts it is made of, the kept JSON read in place (no
        copy until the request's body is made: :meth:`EncodedMessages.parts`)."""
        kept = self._messages
        out, ends = kept.out, kept.ends
        if not out:
            return EncodedMessages(b"", 0, 0, b"[", None)
        with_marks = cache_breakpoints(out, cache)
        head = _encode(with_marks[0]) if with_marks[0] is not out[0] else None
        tail = _encode(with_marks[-1]) if len(out) > 1 and with_marks[-1] is not out[-1] else None
        start = ends[0] if head is not None else 0
        stop = ends[-2] if tail is not None else ends[-1]
        parts = EncodedMessages(kept.joined, start, stop, b"[" + head + b"," if head is not None else b"[", tail)
        kept.lent.add(parts)
        return parts


class EncodedMessages:
    """A request's ``messages`` JSON array as its parts: the kept messages' JSON, read in place
    (:meth:`Prompt.encoded_parts`), between the ones encoded again for the cache's marks.

    What it reads is the prompt's own buffer until the prompt changes it (its next update):
    then it keeps a copy of its part first, so the array it makes is the one it was lent."""

    __slots__ = ("__weakref__", "_head", "_source", "_start", "_stop", "_tail")

    def __init__(self, source: bytearray | bytes, start: int, stop: int, head: bytes, tail: bytes | None) -> None:
        self._source, self._start, self._stop = source, start, stop
        self._head = head
        """``[`` and the first message when it is encoded again (with its comma)"""
        self._tail = tail
        """the last message, when it is encoded again (without its comma)"""

    def keep(self) -> None:
        """Copy the part of the prompt's buffer read (before the prompt changes it)."""
        self._source = bytes(memoryview(self._source)[self._start : self._stop])
        self._start, self._stop = 0, len(self._source)

    def parts(self) -> list[bytes | memoryview]:
        """The array's bytes in order, a view into the prompt's buffer among them (while one is
        held, the prompt's next change goes to a copy of the buffer: :func:`_unshared`)."""
        middle = memoryview(self._source)[self._start : self._stop]
        if self._tail is not None:
            return [self._head, middle, self._tail, b"]"]
        if self._stop > self._start:  # (its last comma left out)
            return [self._head, middle[:-1], b"]"]
        return [self._head[:-1] + b"]" if len(self._head) > 1 else b"[]"]  # (only the first message)

    def join(self) -> bytes:
        """The array's JSON."""
        return b"".join(self.parts())
