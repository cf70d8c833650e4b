"""Condensation policies: small pure functions from a view (and a config) to a condensation.

Strategies (``CondenserConfig.strategy``):

==============  ==========================================================================
``noop``        never forgets
``recent``      sliding window: once over a limit, forgets just enough of the oldest events
                (after the first ``keep_first``) to be back under it; condenses often
``amortized``   once over a limit, forgets the oldest events down to ``target_ratio`` of it,
                so condensations are rare and the kept prefix stays stable for prompt caches
``masking``     forgets nothing; replaces the content of old observations by a placeholder
                at view time (:func:`mask_observations`), the log stays untouched
``summarizing`` like ``amortized``, plus an LLM summary of the forgotten events (and of the
                previous summary) that keeps the task, decisions, files and open problems
``attention``   like ``amortized``, but an LLM picks which of the older events to keep
``pipeline``    ``stages`` in order: masking stages transform the view the next stages see;
                the first stage that condenses wins
==============  ==========================================================================

Limits (each optional): ``max_events`` (visible events, the summary not counted) and
``budget_tokens`` minus ``headroom_tokens`` (room left for the prompt around the view and
the model's answer).  :func:`should_condense` says whether a limit is exceeded (or a
``condensation_request`` asks for it, which is always honoured); :func:`condense` builds the
:class:`~riverbed.events.Condensation`.  A forgotten chunk is always one stretch of the view
between two points that split no action from its observation (nor an ``llm_response`` from
the actions it caused), so the fold drops exactly what the policy chose; the first
``keep_first`` events and the newest group are never forgotten, and neither are the user
messages that say what the agent is doing: the session's first, the task of its latest run
(the one before its ``run_started``) and the latest.  A unit of the View (a tool
call with its result, a model response with its batch) is kept whole or forgotten whole, and
events a user pinned (``context_edit`` ``pin``) are never forgotten.

Masking is not in the log: the agent applies :func:`prepare` to its view before turning it
into chat messages, with the session's config (itself in the log, ``session_config``), so
the context remains a pure function of the log.

LLM strategies call an ``openai.AsyncOpenAI`` client; every failure (HTTP error, timeout,
an empty or unparsable answer) raises :class:`~riverbed.errors.UnavailableError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec

from riverbed.errors import ConfigError, UnavailableError
from riverbed.events import Condensation, Error, Event, Message, Observation, RunStarted, SessionConfig
from riverbed.memory.tokens import PER_EVENT_OVERHEAD, TokenCounter, Tokenizer, event_text
from riverbed.memory.view import Masked, View, unit_links

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionMessageParam

__all__ = [
    "CondenserConfig",
    "Strategy",
    "complete",
    "condense",
    "config_from_log",
    "mask_observations",
    "maskable",
    "masked",
    "masked_count",
    "prepare",
    "should_condense",
]

Strategy = Literal["noop", "recent", "amortized", "masking", "summarizing", "attention", "pipeline"]
_FORGETTING = frozenset({"recent", "amortized", "summarizing", "attention"})


class CondenserConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a session's history is condensed; build it with :meth:`from_dict`.

    In a ``pipeline`` each stage is a full config whose unspecified fields are inherited
    from the pipeline's own fields.
    """

    strategy: Strategy = "amortized"
    max_events: int | None = 100
    budget_tokens: int | None = None
    headroom_tokens: int = 0
    keep_first: int = 1
    target_ratio: float = 0.5
    mask_window: int = 10
    mask_placeholder: str = "[output omitted to save context; a recall can bring it back]"
    model: str | None = None
    tokenizer: Tokenizer = "auto"
    summary_tokens: int = 1024
    llm_timeout: float = 120.0
    stages: tuple[CondenserConfig, ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None) -> CondenserConfig:
        """Validate a config dict (as in ``session_config.condenser``) over ``defaults`` (the
        worker's ``RIVERBED_CONDENSER_*``: the fields ``raw`` does not set); raise ConfigError
        on bad values."""
        if raw is None and not defaults:
            return cls()
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"the condenser config must be an object, not {type(raw).__name__}")
        data = {**(defaults or {}), **(raw or {})}
        stages = data.get("stages")
        if stages is not None:
            if not isinstance(stages, list | tuple) or not all(isinstance(s, Mapping) for s in stages):
                raise ConfigError("condenser config: 'stages' must be a list of condenser config objects")
            inherited = {k: v for k, v in data.items() if k not in ("strategy", "stages")}
            data["stages"] = [{**inherited, **stage} for stage in stages]
        try:
            config = msgspec.convert(data, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad condenser config: {exc}") from exc
        config.validate()
        return config

    def validate(self) -> None:
        def bad(message: str) -> ConfigError:
            return ConfigError(f"bad condenser config ({self.strategy}): {message}")

        if self.keep_first < 0:
            raise bad("keep_first must be 0 or more")
        if self.max_events is not None and self.max_events < self.keep_first + 2:
            raise bad(f"max_events must be at least keep_first + 2 (= {self.keep_first + 2})")
        if self.budget_tokens is not None and self.budget_tokens <= 0:
            raise bad("budget_tokens must be positive")
        if self.headroom_tokens < 0:
            raise bad("headroom_tokens must be 0 or more")
        if self.budget_tokens is not None and self.headroom_tokens >= self.budget_tokens:
            raise bad("headroom_tokens must be smaller than budget_tokens")
        if not 0 < self.target_ratio <= 1:
            raise bad("target_ratio must be in (0, 1]")
        if self.mask_window < 1:
            raise bad("mask_window must be at least 1")
        if self.summary_tokens < 16:
            raise bad("summary_tokens must be at least 16")
        if self.llm_timeout <= 0:
            raise bad("llm_timeout must be positive")
        limit = self.token_limit
        if self.strategy == "summarizing" and limit is not None and self.summary_tokens >= limit * self.target_ratio:
            raise bad("summary_tokens must be well below (budget_tokens - headroom_tokens) * target_ratio")
        if self.strategy == "pipeline":
            if not self.stages:
                raise bad("a pipeline needs at least one stage in 'stages'")
            for stage in self.stages:
                if stage.strategy == "pipeline":
                    raise bad("pipelines cannot be nested")
                stage.validate()
        elif self.stages:
            raise bad("'stages' is only for the pipeline strategy")

    @property
    def token_limit(self) -> int | None:
        """Tokens the view may use: ``budget_tokens - headroom_tokens`` (None: no token limit)."""
        return None if self.budget_tokens is None else self.budget_tokens - self.headroom_tokens

    @property
    def forgets(self) -> bool:
        """Whether this stage forgets events: its budget is what makes the view condense."""
        return self.strategy in _FORGETTING

    def flat(self) -> tuple[CondenserConfig, ...]:
        """The stages to run: a pipeline's stages, or this config alone."""
        return self.stages if self.strategy == "pipeline" else (self,)


def config_from_log(events: Iterable[Event], defaults: Mapping[str, Any] | None = None) -> CondenserConfig:
    """The condenser config in force after these events: the last ``session_config`` that sets
    one, over ``defaults`` (the ``RIVERBED_CONDENSER_*`` settings)."""
    raw: Mapping[str, Any] | None = None
    for event in events:
        if isinstance(event, SessionConfig) and event.condenser is not None:
            raw = event.condenser
    return CondenserConfig.from_dict(raw, defaults)


# --- view-time transformations ----------------------------------------------------------


def mask_observations(view: View, config: CondenserConfig) -> View:
    """Hide the content of old observations behind ``config.mask_placeholder``.

    Observations older than the newest ``mask_window`` are masked (errors are kept: they are
    short and matter), the boundary moving in steps of ``mask_window // 2`` so the masked
    prefix changes rarely.  A masked observation becomes a :class:`~riverbed.memory.view.Masked`
    event with the same id and cause; only observations longer than the placeholder change.
    """
    positions = [i for i, e in enumerate(view.events) if maskable(e, view.pinned)]
    count = masked_count(len(positions), config)
    if count == 0:
        return view
    events = list(view.events)
    for i in positions[:count]:
        events[i] = masked(events[i], config.mask_placeholder)
    return View(tuple(events), view.last_id, view.summary_index, view.pinned)


def maskable(event: Event, pinned: frozenset[int]) -> bool:
    """Whether masking may hide ``event``: an observation, not an error, not masked already,
    not pinned."""
    return isinstance(event, Observation) and not isinstance(event, Error | Masked) and event.id not in pinned


def masked_count(maskable_count: int, config: CondenserConfig) -> int:
    """How many of the view's maskable observations, the oldest first, masking hides."""
    step = max(1, config.mask_window // 2)
    return max(0, maskable_count - config.mask_window) // step * step


def masked(original: Event, placeholder: str) -> Event:
    """``original`` as masking shows it: itself when its text is no longer than the placeholder."""
    if len(event_text(original)) <= len(placeholder):
        return original
    return Masked(
        id=original.id,
        source=original.source,
        cause=original.cause,
        ts=original.ts,
        agent=original.agent,
        tenant=original.tenant,
        trace=original.trace,
        original_kind=original.kind,
        content=placeholder,
    )


def prepare(view: View, config: CondenserConfig) -> View:
    """The view as the model should see it: the config's masking stages applied."""
    for stage in config.flat():
        if stage.strategy == "masking":
            view = mask_observations(view, stage)
    return view


# --- triggers ---------------------------------------------------------------------------


def _counter(stage: CondenserConfig, model: str | None = None) -> TokenCounter:
    return TokenCounter(stage.model or model, stage.tokenizer)


def _over(view: View, stage: CondenserConfig, counter: TokenCounter) -> bool:
    if stage.max_events is not None and len(view) - (view.summary_index is not None) > stage.max_events:
        return True
    limit = stage.token_limit
    return limit is not None and counter.events(view) > limit


def should_condense(view: View, config: CondenserConfig, requested: bool = False) -> bool:
    """Whether :func:`condense` should run now (a request always says yes)."""
    if requested:
        return True
    for stage in config.flat():
        if stage.strategy == "masking":
            view = mask_observations(view, stage)
        elif stage.strategy in _FORGETTING and _over(view, stage, _counter(stage)):
            return True
    return False


# --- choosing what to forget ------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    events: list[Event]  # the view's events without the summary
    head: int  # events[:head] are kept (keep_first, widened to a safe point)
    cut: int  # events[head:cut] are forgotten
    protected: int  # events[protected:] (the newest group) are never forgotten
    links: list[tuple[int, int]]  # index pairs that must stay together
    pinned: frozenset[int]  # indices of events a user pinned: never forgotten

    @property
    def forget(self) -> list[bool]:
        """Per event: whether the policy's cut forgets it."""
        return [self.head <= i < self.cut and i not in self.pinned for i in range(len(self.events))]

    @property
    def forgotten(self) -> list[Event]:
        return [e for e, gone in zip(self.events, self.forget, strict=True) if gone]


def _tasks(events: list[Event]) -> frozenset[int]:
    """Indices of the user messages that say what the agent is doing, never forgotten: the
    first one, the task of the latest run (the user message before its ``run_started``) and
    the latest one."""
    users = [i for i, e in enumerate(events) if isinstance(e, Message) and e.source == "user"]
    if not users:
        return frozenset()
    kept = {users[0], users[-1]}
    opened = next((i for i in range(len(events) - 1, -1, -1) if isinstance(events[i], RunStarted)), None)
    if opened is not None:
        task = next((i for i in reversed(users) if i < opened), None)
        if task is not None:
            kept.add(task)
    return frozenset(kept)


def _safe_points(n: int, links: list[tuple[int, int]]) -> list[bool]:
    """``safe[b]``: cutting before index ``b`` separates no linked pair."""
    diff = [0] * (n + 2)
    for a, b in links:
        diff[a + 1] += 1
        diff[b + 1] -= 1
    safe, depth = [], 0
    for b in range(n + 1):
        depth += diff[b]
        safe.append(depth == 0)
    return safe


def _plan(view: View, stage: CondenserConfig, counter: TokenCounter, requested: bool) -> _Plan | None:
    events = view.real_events()
    n = len(events)
    links = unit_links(events)
    safe = _safe_points(n, links)
    pinned = frozenset(i for i, e in enumerate(events) if e.id in view.pinned) | _tasks(events)
    head = next(b for b in range(min(stage.keep_first, n), n + 1) if safe[b])
    protected = next((b for b in range(n - 1, -1, -1) if safe[b]), 0)
    if protected <= head:
        return None
    tokens = [counter.event(e) for e in events]
    suffix = [0] * (n + 1)
    pins = [0] * (n + 1)  # pins[i]: pinned events in events[:i] (they stay, wherever the cut is)
    pin_tokens = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + tokens[i]
    for i in range(n):
        pins[i + 1] = pins[i] + (i in pinned)
        pin_tokens[i + 1] = pin_tokens[i] + (tokens[i] if i in pinned else 0)
    ratio = 1.0 if stage.strategy == "recent" else stage.target_ratio
    max_events = None if stage.max_events is None else max(1, int(stage.max_events * ratio))
    limit = stage.token_limit
    max_tokens = None if limit is None else int(limit * ratio)
    if stage.strategy == "summarizing":
        head_tokens = suffix[0] - suffix[head] + stage.summary_tokens + PER_EVENT_OVERHEAD
    else:
        head_tokens = suffix[0] - suffix[head] + (counter.event(view.summary) if view.summary else 0)

    def fits(cut: int) -> bool:
        if max_events is not None and head + pins[cut] - pins[head] + n - cut > max_events:
            return False
        return max_tokens is None or head_tokens + pin_tokens[cut] - pin_tokens[head] + suffix[cut] <= max_tokens

    cuts = [b for b in range(head + 1, protected + 1) if safe[b]]
    cut = next((b for b in cuts if fits(b)), protected)
    if requested:
        middle = (head + protected + 1) // 2
        cut = max(cut, next(b for b in cuts if b >= middle))
    if all(i in pinned for i in range(head, cut)):
        return None
    return _Plan(events, head, cut, protected, links, pinned)


def _ranges(events: list[Event], forget: list[bool]) -> list[tuple[int, int]]:
    """Inclusive id ranges covering each run of forgotten events (in view order)."""
    ranges: list[tuple[int, int]] = []
    run_start: int | None = None
    last: int | None = None
    for event, gone in zip(events, forget, strict=True):
        if gone and event.id is not None:
            if run_start is None:
                run_start = event.id
            last = event.id
        elif not gone and run_start is not None and last is not None:
            ranges.append((run_start, last))
            run_start = None
    if run_start is not None and last is not None:
        ranges.append((run_start, last))
    return ranges


# --- the entry point --------------------------------------------------------------------


async def condense(
    view: View,
    config: CondenserConfig,
    llm_client: AsyncOpenAI | Callable[[], AsyncOpenAI] | None = None,
    *,
    requested: bool = False,
    model: str | None = None,
) -> Condensation | None:
    """The condensation the config's policy makes of this view, or None when none is due.

    ``requested`` (a ``condensation_request`` is pending) forces the first forgetting stage
    to forget at least half of what it may, and the result is then never None (an empty
    condensation when there is nothing to forget, so the request still gets its answer).
    ``model`` is the chat model used when the config names none.
    """
    for stage in config.flat():
        if stage.strategy == "masking":
            view = mask_observations(view, stage)
            continue
        if stage.strategy not in _FORGETTING:
            continue
        counter = _counter(stage, model)
        if not (requested or _over(view, stage, counter)):
            continue
        plan = _plan(view, stage, counter, requested)
        if plan is None:
            continue
        if stage.strategy == "summarizing":
            return await _summarize(
                view, plan, stage=stage, counter=counter, client=_client(llm_client, stage), model=model
            )
        if stage.strategy == "attention":
            return await _attend(plan, stage, counter, _client(llm_client, stage), model)
        return Condensation(forgotten=_ranges(plan.events, plan.forget))
    return Condensation() if requested else None


def _client(client: AsyncOpenAI | Callable[[], AsyncOpenAI] | None, stage: CondenserConfig) -> AsyncOpenAI:
    """The client an LLM stage asks (one given as a function is made at the first such stage)."""
    if client is None:
        raise ConfigError(
            f"the {stage.strategy} condenser needs an LLM: set OPENAI_API_KEY (and OPENAI_BASE_URL for "
            "a compatible server), or choose the amortized strategy"
        )
    return client() if callable(client) else client


# --- LLM policies -----------------------------------------------------------------------

_SUMMARY_PROMPT = """\
You keep the memory of an AI agent that works on a task with tools. Older events are being
removed from its context; your summary replaces them (and the previous summary, if any),
so anything you leave out is gone for the agent. Write plain text under these headings:

TASK: what the user asked for, with every requirement and constraint, in their words where it matters.
DONE: decisions taken and steps completed, with results (commands, outcomes, values found).
FILES: every file path read, created or changed, and what about it matters.
OPEN PROBLEMS: errors not yet solved, failing tests, questions, anything left unfinished.
NEXT STEPS: what the agent was about to do.

Be specific (exact paths, names, numbers, error messages); drop chatter and raw output that no
longer matters. Stay under {words} words."""

_ATTENTION_PROMPT = """\
You manage the context of an AI agent that works on a task with tools. Its context is too long:
from the events listed, choose the ones the agent must still see to finish its task (the task,
decisions, relevant errors, file contents it is still working on) and drop the rest (obsolete
or redundant output). Keep at most {count} events. Answer with JSON only: {{"keep": [event ids]}}"""


def _excerpt(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 3 // 4
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-(limit - head) :]}"


def _render(events: Iterable[Event], limit: int) -> str:
    return "\n".join(f"[{e.id}] {e.kind} ({e.source}): {_excerpt(event_text(e), limit)}" for e in events)


def _model(stage: CondenserConfig, model: str | None) -> str:
    name = stage.model or model
    if not name:
        raise ConfigError(
            f"the {stage.strategy} condenser needs a model: set 'model' in its config or RIVERBED_LLM_MODEL"
        )
    return name


async def complete(
    client: AsyncOpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    timeout: float,
    *,
    who: str = "the condenser's model",
) -> str:
    """One chat completion's text, stripped; a failing, late or silent model is an
    :class:`UnavailableError` that names the model as ``who``."""
    import openai  # noqa: PLC0415  (loaded only by the steps that call a model)

    try:
        with anyio.fail_after(timeout):
            response = await client.chat.completions.create(model=model, messages=messages)
    except TimeoutError as exc:
        raise UnavailableError(f"{who} {model!r} did not answer within {timeout:g} s") from exc
    except openai.OpenAIError as exc:
        raise UnavailableError(f"{who} {model!r} failed: {exc}") from exc
    content = response.choices[0].message.content if response.choices else None
    if not content or not content.strip():
        raise UnavailableError(f"{who} {model!r} returned an empty answer")
    return content.strip()


def _clip(text: str, max_tokens: int, counter: TokenCounter) -> str:
    """``text`` cut to at most ``max_tokens`` tokens (a summary must fit the room kept for it)."""
    while (count := counter.text(text)) > max_tokens:
        text = text[: max(1, int(len(text) * max_tokens / count * 0.95))]
    return text


async def _summarize(
    view: View, plan: _Plan, *, stage: CondenserConfig, counter: TokenCounter, client: AsyncOpenAI, model: str | None
) -> Condensation:
    previous = view.summary.content if view.summary is not None else "(none)"
    name = _model(stage, model)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": _SUMMARY_PROMPT.format(words=stage.summary_tokens * 3 // 4)},
        {
            "role": "user",
            "content": f"<previous_summary>\n{previous}\n</previous_summary>\n"
            f"<events>\n{_render(plan.forgotten, 2000)}\n</events>",
        },
    ]
    summary = _clip(await complete(client, name, messages, stage.llm_timeout), stage.summary_tokens, counter)
    return Condensation(forgotten=_ranges(plan.events, plan.forget), summary=summary, summary_offset=plan.head)


async def _attend(
    plan: _Plan, stage: CondenserConfig, counter: TokenCounter, client: AsyncOpenAI, model: str | None
) -> Condensation:
    events, head, protected = plan.events, plan.head, plan.protected
    room = protected - plan.cut  # the policy's default keeps events[cut:protected]
    tokens = [counter.event(e) for e in events]
    room_tokens = sum(tokens[plan.cut : protected])
    name = _model(stage, model)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": _ATTENTION_PROMPT.format(count=room)},
        {"role": "user", "content": f"<events>\n{_render(events[head:protected], 300)}\n</events>"},
    ]
    answer = await complete(client, name, messages, stage.llm_timeout)
    try:
        picked = set(_parse_keep(answer))
    except ValueError as exc:
        raise UnavailableError(f"the condenser's model {name!r} did not answer with a JSON list of ids: {exc}") from exc
    # Whole groups (an action with its observations) are kept or dropped together.
    root = list(range(len(events)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for a, b in plan.links:
        if head <= a < protected:
            root[find(b)] = find(a)
    groups: dict[int, list[int]] = {}
    for i in range(head, protected):
        groups.setdefault(find(i), []).append(i)
    keep = [False] * len(events)
    used = used_tokens = 0
    for members in sorted(groups.values(), key=lambda m: m[-1], reverse=True):
        if not any(events[i].id in picked for i in members):
            continue
        size, cost = len(members), sum(tokens[i] for i in members)
        if used + size <= room and used_tokens + cost <= room_tokens:
            used, used_tokens = used + size, used_tokens + cost
            for i in members:
                keep[i] = True
    forget = [head <= i < protected and not keep[i] and i not in plan.pinned for i in range(len(events))]
    return Condensation(forgotten=_ranges(events, forget))


def _parse_keep(answer: str) -> list[int]:
    """Event ids from a JSON answer: ``{"keep": [ids]}`` or a bare list, possibly in a code fence."""
    match = re.search(r"[\[{].*[\]}]", answer, re.DOTALL)
    if match is None:
        raise ValueError("no JSON in the answer")
    data = json.loads(match.group(0))
    ids = data.get("keep") if isinstance(data, dict) else data
    if not isinstance(ids, list):
        raise ValueError("no 'keep' list in the answer")  # noqa: TRY004  (a bad answer, not a bad argument)
    return [int(i) for i in ids if isinstance(i, int | str) and str(i).strip().lstrip("-").isdigit()]
