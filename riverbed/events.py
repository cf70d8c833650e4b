"""The event vocabulary: every kind of event riverbed knows, and its codecs.

Events are frozen msgspec Structs in one tagged union (``tag_field="kind"``).
The wire form on the stream is msgpack; the human and cross-language form is
JSON with the same field names.  ``id`` is never stored in a payload: it is the
stream entry id, attached when an event is read back.

Schema evolution:

- every kind has a schema version (``Event.version``); payloads carry it as ``v``;
- an older payload is upcast on read by the functions registered with
  :func:`upcaster`; new fields get defaults and go last; a tag is never reused;
- a kind this version does not know decodes to :class:`Unknown`, which keeps
  the raw payload, so nothing is ever dropped.

Users add their own action kinds with :func:`register`.  This module imports
nothing else from riverbed but the exception tree (``riverbed.errors``, a leaf).

Input from users and agents is checked at the boundary, before anything is appended:

- numeric bounds live in the schema itself (``riverbed schema`` shows them): a timeout
  is a finite number of seconds in (0, :data:`MAX_TIMEOUT`], ``k`` is 1 to :data:`MAX_K`,
  line numbers start at 1;
- :func:`from_json` and :func:`from_builtins` refuse a field the kind does not have, with
  a "did you mean" hint; the log's own decoders (:func:`decode`, :func:`decode_json`)
  still ignore fields a newer version wrote, so old workers read new logs;
- :func:`check` refuses nesting deeper than :data:`MAX_DEPTH`, a payload over a size
  limit, and a ``session_config`` that sets a name in :data:`RESERVED_ENV`;
- :func:`check_client` refuses what only the system writes.  Clients (the HTTP API,
  ``riverbed append`` and ``act``, a handle acting for a tenant) append actions, messages,
  ``session_config``, context edits, an agent's ``llm_response`` and ``error`` and a user's
  ``condensation``; every other kind (``forked``, ``sandbox_rebuilt``, the roles'
  observations, the sub-agents' ``delegate``, ``delegated`` and ``delegate_result``) and
  every other ``source`` comes only from a role, ``fork()`` or import,
  which append through the log itself (``Log.append``), not through a client handle.  Each
  kind says who may write it in :attr:`Event.client_sources`.

An event written before a bound existed and outside it reads back as ``unknown`` (its raw
payload kept): it is never dropped, and never executed with the bad value.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, Union

import msgspec
import msgspec.inspect
from msgspec.structs import force_setattr, replace

from riverbed.errors import DecodeError, InputError, SystemEventRefused

__all__ = [
    "MAX_DEPTH",
    "MAX_K",
    "MAX_SKIPPED",
    "MAX_TIMEOUT",
    "RESERVED_ENV",
    "SECRET_NAME_PATTERN",
    "Action",
    "Approval",
    "CmdOutput",
    "CmdRun",
    "Condensation",
    "CondensationRequest",
    "ContextEdit",
    "DecodeError",
    "Delegate",
    "DelegateResult",
    "Delegated",
    "Divergence",
    "Error",
    "Event",
    "FileContent",
    "FileEdit",
    "FileEdited",
    "FileRead",
    "FileWrite",
    "FileWritten",
    "Finish",
    "Forked",
    "Hit",
    "Knowledge",
    "LlmResponse",
    "McpList",
    "McpTool",
    "McpTools",
    "Message",
    "Observation",
    "PythonOutput",
    "PythonRun",
    "Recall",
    "RecallResult",
    "Risk",
    "RunCancel",
    "RunPaused",
    "RunResumed",
    "RunStarted",
    "RunUpgraded",
    "SandboxRebuilt",
    "SessionConfig",
    "Skipped",
    "Source",
    "Think",
    "ToolCall",
    "ToolResult",
    "Unknown",
    "WorkspaceMethod",
    "check",
    "check_client",
    "check_env",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "events_from_json",
    "from_builtins",
    "from_json",
    "json_schema",
    "kind_of",
    "kinds",
    "register",
    "to_builtins",
    "upcaster",
    "with_id",
]

Source: TypeAlias = Literal["agent", "user", "runtime", "memory", "condenser", "system"]
Role: TypeAlias = Literal["runtime", "memory", "condenser", "agent"]
WorkspaceMethod: TypeAlias = Literal["replay", "copy", "empty"]

MAX_TIMEOUT = 86_400.0
"""The longest timeout an action may ask for, in seconds (a day)."""
MAX_K = 100
"""The most hits one recall may ask for."""
MAX_DEPTH = 64
"""How deeply lists and objects may nest inside an event given by a user."""
MAX_RUN_STEPS = 10_000
"""The most model calls one run may be given."""

Timeout: TypeAlias = Annotated[
    float,
    msgspec.Meta(gt=0, le=MAX_TIMEOUT, description="seconds: a finite number greater than 0, at most a day"),
]
LineNumber: TypeAlias = Annotated[int, msgspec.Meta(ge=1, description="1-based line number")]
EventId: TypeAlias = Annotated[int, msgspec.Meta(ge=1, description="an event id of this session")]
TopK: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=MAX_K, description="how many hits, 1 to 100")]

RESERVED_ENV = frozenset(
    {
        # The runtime's shell protocol: its prompt carries the end-of-command marker.
        "PROMPT_COMMAND",
        "PS0",
        "PS1",
        "PS2",
        "PS4",
        "HISTFILE",
        # What bash reads at start-up or on every command: they change how the runtime's
        # own hidden commands are parsed and run, or end the shell (TMOUT).
        "BASH_ENV",
        "ENV",
        "IFS",
        "SHELLOPTS",
        "BASHOPTS",
        "BASH_XTRACEFD",
        "TMOUT",
        # Loaded into every process of the sandbox, its launcher included.
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
    }
)
"""Environment names a ``session_config`` may not set or unset: the sandbox's shell and
launcher depend on them.  ``PATH``, ``HOME`` and the rest may be set."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Fields every event has.  ``id`` is the per-session event id (None until appended)."""

    version: ClassVar[int] = 1
    client_sources: ClassVar[frozenset[str]] = frozenset()
    """The sources a client may append this kind with (:func:`check_client`); empty: only
    the system writes it (a role, ``fork()``, import).  A custom kind that clients append
    names its sources here (an :class:`Action` has ``agent`` and ``user`` already)."""

    id: int | None = None
    source: Source = "agent"
    cause: int | None = None
    ts: dt.datetime = msgspec.field(default_factory=_now)
    agent: str | None = None
    tenant: str | None = None
    trace: str | None = None
    v: int = 1

    @property
    def kind(self) -> str:
        return kind_of(type(self))


class Risk(msgspec.Struct, frozen=True, kw_only=True):
    """A call's risk as the agent's analyzer labelled it, with why; ``confirm``: the run's
    policy makes it wait for a person's approval."""

    level: Literal["low", "medium", "high", "unknown"]
    reason: str = ""
    confirm: bool = False


class Action(Event, frozen=True, kw_only=True):
    """Something an agent (or user) asks for.

    ``answered_by`` names the role that answers it with exactly one observation
    (``None``: a record that nobody answers, like a message).  ``repeatable``
    marks reads that a new owner may run again after a crash.
    """

    answered_by: ClassVar[Role | None] = "runtime"
    repeatable: ClassVar[bool] = False
    client_sources: ClassVar[frozenset[str]] = frozenset(("agent", "user"))

    tool_call_id: str | msgspec.UnsetType = msgspec.UNSET
    """The id of the model's tool call this action answers (an agent that calls tools records
    it; ``riverbed.agent.messages`` pairs calls and results by it).  Left unset it is not
    written at all, so logs from before this field existed read and export byte for byte."""

    risk: Risk | msgspec.UnsetType = msgspec.UNSET
    """How risky the agent judged this call, and whether it waits for a person's ``approval``
    before any role runs it (``confirm``).  Unset (not written) for actions nobody judged."""

    @property
    def answering_role(self) -> Role | None:
        """The role that answers this action: its kind's :attr:`answered_by`, except for kinds
        whose answer depends on the call (a ``tool_call`` says where its tool runs)."""
        return type(self).answered_by

    @property
    def awaits_approval(self) -> bool:
        """Whether no role may run it before an ``approval`` names it."""
        return isinstance(self.risk, Risk) and self.risk.confirm


class Observation(Event, frozen=True, kw_only=True):
    """The answer to an action; ``cause`` is the action's id."""

    source: Source = "runtime"


# --- actions -----------------------------------------------------------------------------


class Message(Action, frozen=True, kw_only=True, tag="message"):
    answered_by: ClassVar[Role | None] = None

    content: str
    wait_for_response: bool = False
    images: (
        Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=16)] | msgspec.UnsetType
    ) = msgspec.UNSET
    """Images that go with the message: ``http(s)://`` or ``data:`` URLs, or paths of files in the
    session's workspace (sent to vision models as ``image_url`` parts).  Unset is not written."""


class CmdRun(Action, frozen=True, kw_only=True, tag="cmd_run"):
    """Run a command in the session's persistent shell.

    ``timeout`` is the hard limit in seconds (None: the worker's default);
    ``is_input`` sends ``command`` as input to the running command
    (``C-c`` interrupts it); ``blocking=False`` returns after the soft timeout
    (no new output) while the command goes on.
    """

    command: str
    timeout: Timeout | None = None
    is_input: bool = False
    blocking: bool = False
    cwd: str | None = None


class FileRead(Action, frozen=True, kw_only=True, tag="file_read"):
    """Read a file; ``start``/``end`` are 1-based inclusive line numbers."""

    repeatable: ClassVar[bool] = True

    path: str
    start: LineNumber = 1
    end: LineNumber | None = None


class FileWrite(Action, frozen=True, kw_only=True, tag="file_write"):
    path: str
    content: str


class FileEdit(Action, frozen=True, kw_only=True, tag="file_edit"):
    command: Literal["view", "create", "str_replace", "insert", "undo_edit"]
    path: str
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: Annotated[int, msgspec.Meta(ge=0, description="insert after this line (0: at the top)")] | None = None


class PythonRun(Action, frozen=True, kw_only=True, tag="python_run"):
    """Run a cell in the session's persistent Python process."""

    code: str
    timeout: Timeout | None = None


class Recall(Action, frozen=True, kw_only=True, tag="recall"):
    answered_by: ClassVar[Role | None] = "memory"
    repeatable: ClassVar[bool] = True

    query: str = ""
    recall_type: Literal["workspace_context", "knowledge", "semantic"] = "semantic"
    scope: Literal["session", "tenant"] = "session"
    k: TopK = 5


class CondensationRequest(Action, frozen=True, kw_only=True, tag="condensation_request"):
    """Ask the condenser to condense now; answered by a ``condensation`` (or ``error``)."""

    answered_by: ClassVar[Role | None] = "condenser"
    repeatable: ClassVar[bool] = True


class Think(Action, frozen=True, kw_only=True, tag="think"):
    answered_by: ClassVar[Role | None] = None

    thought: str


class Finish(Action, frozen=True, kw_only=True, tag="finish"):
    answered_by: ClassVar[Role | None] = None

    final_thought: str = ""
    outputs: dict[str, Any] = msgspec.field(default_factory=dict)


# --- observations ------------------------------------------------------------------------


class CmdOutput(Observation, frozen=True, kw_only=True, tag="cmd_output"):
    content: str
    exit_code: int | None = None
    command: str = ""
    timed_out: bool = False
    truncated: bool = False


class FileContent(Observation, frozen=True, kw_only=True, tag="file_content"):
    path: str
    content: str


class FileWritten(Observation, frozen=True, kw_only=True, tag="file_written"):
    path: str


class FileEdited(Observation, frozen=True, kw_only=True, tag="file_edited"):
    path: str
    diff: str = ""
    content: str = ""


class PythonOutput(Observation, frozen=True, kw_only=True, tag="python_output"):
    """A cell's output: stdout+stderr interleaved, the trailing expression's value,
    the traceback if it raised, and files (images) it saved in the workspace."""

    content: str = ""
    result: str | None = None
    exception: str | None = None
    timed_out: bool = False
    truncated: bool = False
    state_lost: bool = False
    files: list[str] = msgspec.field(default_factory=list)


class Knowledge(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    trigger: str
    content: str


class Hit(msgspec.Struct, frozen=True, kw_only=True):
    session: str
    event_id: int
    kind: str
    score: float
    text: str


class RecallResult(Observation, frozen=True, kw_only=True, tag="recall_result"):
    source: Source = "memory"

    recall_type: Literal["workspace_context", "knowledge", "semantic"]
    repo_name: str | None = None
    repo_branch: str | None = None
    repo_directory: str | None = None
    repo_instructions: str | None = None
    runtime_info: dict[str, Any] = msgspec.field(default_factory=dict)
    date: str | None = None
    conversation_instructions: str | None = None
    knowledge: list[Knowledge] = msgspec.field(default_factory=list)
    hits: list[Hit] = msgspec.field(default_factory=list)
    #: Set when the answer could not wait for indexing to reach the recall: the index held
    #: the session's events 1..indexed_to, not the later ones (unset: every event before it;
    #: unset is not written, so records from before the field read back byte for byte).
    indexed_to: int | msgspec.UnsetType = msgspec.UNSET


class Error(Observation, frozen=True, kw_only=True, tag="error"):
    """Something went wrong; ``retryable`` says whether the same action may succeed later.

    A client writes one only as ``source: agent``: an agent's own failure (the model call,
    its limits, an action it gave up waiting for)."""

    client_sources: ClassVar[frozenset[str]] = frozenset(("agent",))

    content: str
    reason: str = "error"
    retryable: bool = False


class Condensation(Observation, frozen=True, kw_only=True, tag="condensation"):
    """Drop ``forgotten`` id ranges (inclusive) from the view; insert ``summary`` at
    ``summary_offset`` (an index into the condensed view).  A client writes one only as
    ``source: user`` (a proposal it applies: ``riverbed context suggest --apply``)."""

    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    source: Source = "condenser"

    forgotten: list[tuple[EventId, EventId]] = msgspec.field(default_factory=list)
    summary: str | None = None
    summary_offset: Annotated[int, msgspec.Meta(ge=0)] | None = None


# --- system ------------------------------------------------------------------------------


class Forked(Event, frozen=True, kw_only=True, tag="forked"):
    """First event after a fork: this session copies events 1..``at`` of ``source_session``.

    (The contract's ``source`` name clashes with every event's ``source`` field.)
    """

    source: Source = "system"

    source_session: str
    at: EventId
    workspace: WorkspaceMethod = "empty"
    """How the fork's sandbox is built: ``replay`` (the runtime that serves the fork re-runs
    the copied actions 1..``at``), ``copy`` (it copies the source's workspace) or ``empty``.
    Forks recorded before this field existed started empty."""


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """One way a re-executed action's observation differs from the recorded one.

    ``field`` is ``"kind"`` when the observation is of another kind altogether (then
    ``recorded`` and ``new`` are the kinds; ``recorded`` is None when the action was never
    answered in the log).
    """

    action_id: int
    kind: str
    field: str
    recorded: Any = None
    new: Any = None


MAX_SKIPPED = 100
"""The most skipped files a ``sandbox_rebuilt`` event lists."""


class Skipped(msgspec.Struct, frozen=True, kw_only=True):
    """A file of a source workspace that a ``copy`` left out: ``path`` (relative to the
    workspace) and ``reason``: ``fifo``, ``socket`` or ``device`` (special files are never
    copied), ``changed`` (replaced while it was copied, by a symlink or something else:
    never followed) or ``unreadable``."""

    path: str
    reason: str


class SandboxRebuilt(Event, frozen=True, kw_only=True, tag="sandbox_rebuilt"):
    """How the runtime built a fork's sandbox, appended once (``cause`` = the ``forked``
    event) before it runs any new action of the fork.

    ``method`` is the fork's ``workspace``; ``actions`` counts the recorded actions re-run
    (``replay``); ``differences`` lists every observation that came out differently from
    the recording; ``note`` says what else happened (a missing source workspace, a fork
    the runtime refused to build); ``skipped`` lists what a ``copy`` left out.
    """

    source: Source = "runtime"

    method: WorkspaceMethod
    at: EventId
    actions: int = 0
    differences: list[Divergence] = msgspec.field(default_factory=list)
    note: str = ""
    skipped: list[Skipped] | msgspec.UnsetType = msgspec.UNSET
    """Files of the source's workspace a ``copy`` did not copy (the first
    :data:`MAX_SKIPPED`; ``note`` counts them all).  Unset (not written) when it skipped
    none, so records from before this field existed read and export byte for byte."""


class SessionConfig(Event, frozen=True, kw_only=True, tag="session_config"):
    """Session settings, folded from the log: environment variables for the sandbox
    (later values win; ``None`` unsets) and the condenser configuration."""

    client_sources: ClassVar[frozenset[str]] = frozenset(("agent", "user"))

    env: dict[str, str | None] = msgspec.field(default_factory=dict)
    condenser: dict[str, Any] | None = None


class ContextEdit(Event, frozen=True, kw_only=True, tag="context_edit"):
    """A user's edit of the agent's context, folded by the View like a condensation.

    The edit targets the events before it whose id lies in one of ``ranges`` (inclusive;
    no ranges: every id) and whose kind is one of ``kinds`` (no kinds: every kind); at least
    one of the two is given.  ``op``:

    - ``forget`` hides the targets (pinned ones too: pins only bind condensers);
    - ``restore`` shows again targets that a condensation or a ``forget`` hid (restoring one
      id adds a recalled event back);
    - ``pin`` keeps the targets out of every later condensation's reach; ``unpin`` undoes it.

    A tool call, its result and the rest of its model response's batch are one unit: an
    edit that touches one member applies to the whole unit.  ``note`` says why (free text).
    """

    client_sources: ClassVar[frozenset[str]] = frozenset(("agent", "user"))

    source: Source = "user"

    op: Literal["forget", "restore", "pin", "unpin"]
    ranges: list[tuple[EventId, EventId]] = msgspec.field(default_factory=list)
    kinds: list[str] = msgspec.field(default_factory=list)
    note: str | None = None


class LlmResponse(Event, frozen=True, kw_only=True, tag="llm_response"):
    """A model's raw response, recorded before its actions so replay needs no model."""

    client_sources: ClassVar[frozenset[str]] = frozenset(("agent",))

    model: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)
    usage: dict[str, Any] = msgspec.field(default_factory=dict)


# --- runs ---------------------------------------------------------------------------------
# Client-written (``client_sources``: user): a client opens a run (``run_started``) and may
# ask for its end (``run_cancel``).  What the agent role writes for a run (``llm_response``,
# the actions, the ``error`` from ``source: agent`` that ends it) is system-written.


SECRET_NAME_PATTERN = r"[A-Z_][A-Z0-9_]{0,127}"  # noqa: S105  (a name's shape, no secret)
"""What a secret's name is: capital letters, digits and ``_``, not starting with a digit."""
SecretName: TypeAlias = Annotated[str, msgspec.Meta(pattern=f"^{SECRET_NAME_PATTERN}$")]
"""A tenant's secret's name (``riverbed secrets set TENANT NAME``)."""
Confirm: TypeAlias = Literal["never", "always", "risky"] | Annotated[list[str], msgspec.Meta(max_length=100)]

_OutputTokens = Annotated[
    int, msgspec.Meta(ge=0, le=1_000_000, description="tokens one model answer may have (0: the server decides)")
]
_Temperature = Annotated[float, msgspec.Meta(ge=0, le=2, description="the model's sampling temperature")]
_CallSeconds = Annotated[float, msgspec.Meta(gt=0, le=86_400, description="seconds one model call may take")]


class RunStarted(Event, frozen=True, kw_only=True, tag="run_started"):
    """Opens a run on the session: the agent role works on the log's user messages (the task
    is the one appended just before) until ``finish`` or an ``error`` from ``source: agent``
    with reason ``step_limit``, ``budget_exhausted``, ``cancelled`` or ``llm_error``.

    Limits are checked before each model call (a run overspends by at most one call):
    ``max_steps`` model calls, ``max_tokens`` prompt + completion tokens, ``max_cost`` USD
    (priced by ``RIVERBED_PRICES``).  ``model`` None: the worker's ``RIVERBED_LLM_MODEL``;
    ``max_output_tokens``, ``temperature`` and ``llm_timeout`` None: the worker's
    ``RIVERBED_LLM_MAX_OUTPUT_TOKENS``, ``RIVERBED_LLM_TEMPERATURE`` and ``RIVERBED_LLM_TIMEOUT``.
    """

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    model: str | None = None
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_RUN_STEPS, description="model calls at most")] = 30
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="prompt + completion tokens at most")] | None = None
    max_cost: Annotated[float, msgspec.Meta(gt=0, le=1_000_000, description="USD at most")] | None = None
    max_output_tokens: _OutputTokens | None = None
    temperature: _Temperature | None = None
    llm_timeout: _CallSeconds | None = None
    agent_name: str | msgspec.UnsetType = msgspec.UNSET
    """the hosted agent definition that works on the run (unset: the reference agent, ``llm``)"""
    digest: str | msgspec.UnsetType = msgspec.UNSET
    """the digest of that definition when the run opened (unset: whichever a worker hosts)"""
    rules: int | msgspec.UnsetType = msgspec.UNSET
    """the version of the run rules it opened under (unset: runs from before versions, 1)"""
    confirm: Confirm | msgspec.UnsetType = msgspec.UNSET
    """which calls wait for a person's approval: ``never``, ``always``, ``risky`` (those the
    analyzer labels high or unknown) or a list of tool names (unset: the agent's policy)"""
    secrets: Annotated[list[SecretName], msgspec.Meta(max_length=100)] | msgspec.UnsetType = msgspec.UNSET
    """the names of the tenant's secrets the run may use (its agent's and its own; unset: none):
    the values reach the sandbox's environment, stdio MCP servers and Python tools, never the log"""


class RunUpgraded(Event, frozen=True, kw_only=True, tag="run_upgraded"):
    """Lets the session's open run continue on another digest of its agent's definition (and
    the current run rules): ``riverbed agent SESSION --upgrade``.  Without it a worker whose
    definition or rules differ from the run's leaves the run to one that matches."""

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    digest: str
    rules: int
    previous: str | None = None


class Approval(Event, frozen=True, kw_only=True, tag="approval"):
    """A person's decision on calls that wait for approval (their ``risk.confirm``): ``approve``
    lets the roles run them; ``reject`` has each answered by an ``error`` the model reads, with
    ``reason``.  ``by`` names who decided (the API key's name, the CLI user).  Only clients write
    it, and the roles honour it only as ``source: user``."""

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    actions: Annotated[list[EventId], msgspec.Meta(max_length=1000)]
    decision: Literal["approve", "reject"]
    reason: Annotated[str, msgspec.Meta(max_length=4000)] = ""
    by: Annotated[str, msgspec.Meta(max_length=200)] = ""


class RunPaused(Event, frozen=True, kw_only=True, tag="run_paused"):
    """Pauses the session's open run: no model call and no new action until ``run_resumed``
    (an action already running finishes).  A paused run holds no worker."""

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    note: str = ""


class RunResumed(Event, frozen=True, kw_only=True, tag="run_resumed"):
    """Resumes a paused run."""

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    note: str = ""


class RunCancel(Event, frozen=True, kw_only=True, tag="run_cancel"):
    """Asks the agent role to end the session's open run (with an ``error``, reason ``cancelled``)."""

    source: Source = "user"
    client_sources: ClassVar[frozenset[str]] = frozenset(("user",))

    note: str = ""


# --- sub-agents ---------------------------------------------------------------------------
# System-written (``client_sources`` empty): the agent role appends a run's ``delegate``
# actions as its model calls them, creates each child session (``delegated`` first), and
# answers each ``delegate`` once with a ``delegate_result`` (or an ``error`` when a limit
# refuses it).  ``riverbed/agent/delegation.py`` has the rules.


class Delegate(Action, frozen=True, kw_only=True, tag="delegate"):
    """Hand ``task`` to a sub-agent: a child session with a run of its own, served by the agent
    role; answered once by a ``delegate_result`` when the child's run ends.  Limits are the
    child's own, at most its share of what the parent has left."""

    answered_by: ClassVar[Role | None] = "agent"
    client_sources: ClassVar[frozenset[str]] = frozenset()

    task: str
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_RUN_STEPS, description="model calls at most")] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="prompt + completion tokens at most")] | None = None
    max_cost: Annotated[float, msgspec.Meta(gt=0, le=1_000_000, description="USD at most")] | None = None
    sub_agent: str | msgspec.UnsetType = msgspec.UNSET
    """the hosted agent that works on the task (one of the parent agent's ``sub_agents``;
    unset: the parent's own definition)"""


class Delegated(Event, frozen=True, kw_only=True, tag="delegated"):
    """The first event of a child session: it works for ``parent``'s ``delegate`` action
    ``parent_action``; ``depth`` counts the sessions above it (a child of a top-level run: 1)."""

    source: Source = "system"

    parent: str
    parent_action: EventId
    depth: Annotated[int, msgspec.Meta(ge=1)] = 1


class DelegateResult(Observation, frozen=True, kw_only=True, tag="delegate_result"):
    """The answer to a ``delegate``: the child ``session``'s run ended (``state`` finished,
    failed or cancelled) with ``content`` (its final message, or its error).  ``tokens`` and
    ``cost`` are what the child's run and its own sub-agents spent (counted into the parent's
    budget); ``cost`` None: not every step had a price."""

    source: Source = "agent"

    session: str
    content: str
    state: str = "finished"
    tokens: int = 0
    cost: float | None = 0.0


# --- tools ----------------------------------------------------------------------------------
# System-written: the agent role appends a ``tool_call`` for each call of a user's tool or an
# MCP server's tool, and the worker that runs it answers it once with a ``tool_result`` (or an
# ``error``: ``tool_lost`` when the worker that started it died).


class ToolCall(Action, frozen=True, kw_only=True, tag="tool_call"):
    """A call of a hosted agent's tool: a Python function (``runs_in`` agent: the agent worker
    that hosts it runs it) or an MCP server's tool, named ``<server>.<tool>`` (``server`` set;
    a stdio server runs in the session's sandbox, ``runs_in`` runtime; a remote one is called
    from the agent worker).  ``arguments`` were checked against the tool's schema."""

    answered_by: ClassVar[Role | None] = "agent"
    client_sources: ClassVar[frozenset[str]] = frozenset()

    tool: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    runs_in: Literal["agent", "runtime"] = "agent"
    server: str | None = None

    @property
    def answering_role(self) -> Role | None:
        return self.runs_in


class ToolResult(Observation, frozen=True, kw_only=True, tag="tool_result"):
    """The answer to a ``tool_call``: what the tool returned (text, or JSON as text), or what
    went wrong when ``is_error`` (the model reads it either way)."""

    source: Source = "agent"

    content: str
    is_error: bool = False


class McpList(Action, frozen=True, kw_only=True, tag="mcp_list"):
    """Ask an MCP server which tools it has, the first time a run uses it; answered once by
    ``mcp_tools`` (or an ``error``).  A stdio server (``command``) is started in the session's
    sandbox by the runtime role (``runs_in`` runtime) and lives as long as the sandbox; a
    remote one (``url``) is asked from the agent worker.  ``env`` names environment variables
    the server gets (values come from the session's configuration or secrets)."""

    answered_by: ClassVar[Role | None] = "agent"
    repeatable: ClassVar[bool] = True
    client_sources: ClassVar[frozenset[str]] = frozenset()

    server: str
    command: list[str] | None = None
    url: str | None = None
    env: list[str] = msgspec.field(default_factory=list)
    timeout: Timeout = 30.0
    runs_in: Literal["agent", "runtime"] = "runtime"

    @property
    def answering_role(self) -> Role | None:
        return self.runs_in


class McpTool(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(default_factory=dict)


class McpTools(Observation, frozen=True, kw_only=True, tag="mcp_tools"):
    """The tools an MCP server listed (names and schemas), as the model was offered them."""

    server: str
    tools: list[McpTool] = msgspec.field(default_factory=list)


class Unknown(Event, frozen=True, kw_only=True, tag="unknown"):
    """An event whose kind (or version) this version cannot decode; ``payload`` keeps it all."""

    source: Source = "system"

    original_kind: str = ""
    payload: dict[str, Any] = msgspec.field(default_factory=dict)


# --- registry and codecs -----------------------------------------------------------------

_BUILTIN: tuple[type[Event], ...] = (
    Message,
    CmdRun,
    FileRead,
    FileWrite,
    FileEdit,
    PythonRun,
    Recall,
    CondensationRequest,
    Think,
    Finish,
    CmdOutput,
    FileContent,
    FileWritten,
    FileEdited,
    PythonOutput,
    RecallResult,
    Error,
    Condensation,
    Forked,
    SandboxRebuilt,
    SessionConfig,
    LlmResponse,
    ContextEdit,
    RunStarted,
    RunCancel,
    Delegate,
    Delegated,
    DelegateResult,
    RunUpgraded,
    Approval,
    RunPaused,
    RunResumed,
    ToolCall,
    ToolResult,
    McpList,
    McpTools,
    Unknown,
)

RESERVED_KINDS = frozenset({"summary", "masked"})
"""Tags used by view-only items (``riverbed.memory.view``); no logged kind may take them."""

_kinds: dict[str, type[Event]] = {}
_upcasters: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_raw_msgpack = msgspec.msgpack.Decoder(dict[str, Any])
_raw_json = msgspec.json.Decoder(dict[str, Any])
_any_json = msgspec.json.Decoder(float_hook=float)  # 1e999 is inf, refused by the bound that names it


class _Codecs:
    """Typed decoders over the current union; rebuilt when a kind is registered."""

    def __init__(self, classes: Iterable[type[Event]]) -> None:
        union: Any = Union[tuple(classes)]  # noqa: UP007  (a runtime-built union)
        self.msgpack = msgspec.msgpack.Decoder(union)
        self.json = msgspec.json.Decoder(union)


def kind_of(cls: type[Event]) -> str:
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} has no kind tag")
    return tag


def register(cls: type[Event]) -> type[Event]:
    """Add an event kind (usually a custom :class:`Action`); usable as a class decorator.

    The class must be a frozen ``kw_only`` Struct subclass of :class:`Event` with an
    explicit ``tag``.  Registering a tag that is taken by another class is an error.
    """
    global _codecs
    if not (isinstance(cls, type) and issubclass(cls, Event)):
        raise TypeError("only Event subclasses can be registered")
    kind = kind_of(cls)
    if kind in RESERVED_KINDS:
        raise ValueError(f"the event kind {kind!r} is reserved (it names view-only items)")
    existing = _kinds.get(kind)
    if existing is cls:
        return cls
    if existing is not None:
        raise ValueError(f"the event kind {kind!r} is already registered by {existing.__name__}")
    _kinds[kind] = cls
    _codecs = _Codecs(_kinds.values())
    return cls


def upcaster(
    kind: str, from_version: int
) -> Callable[[Callable[[dict[str, Any]], dict[str, Any]]], Callable[[dict[str, Any]], dict[str, Any]]]:
    """Register a function that turns a ``kind`` payload of ``from_version`` into the next version."""

    def deco(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
        _upcasters[(kind, from_version)] = fn
        return fn

    return deco


def for_runtime(event: Event) -> bool:
    """Whether the runtime role answers this event: an action it runs, or one of a kind this
    version cannot decode that a client sent (answered with an error)."""
    if isinstance(event, Action):
        return event.answering_role == "runtime"
    return isinstance(event, Unknown) and event.source in ("agent", "user") and bool(event.original_kind)


def class_of(kind: str) -> type[Event] | None:
    """The class registered for ``kind`` (None: no such kind)."""
    return _kinds.get(kind)


def kinds() -> dict[str, type[Event]]:
    """Every registered kind, by wire name."""
    return dict(_kinds)


for _cls in _BUILTIN:
    _kinds[kind_of(_cls)] = _cls
_codecs = _Codecs(_kinds.values())


def with_id(event: Event, event_id: int) -> Event:
    """The event carrying ``event_id`` (events read from a log carry their id)."""
    if event.id == event_id:
        return event
    return replace(event, id=event_id)


def _strip_id(event: Event) -> Event:
    return event if event.id is None else replace(event, id=None)


def encode(event: Event) -> bytes:
    """The msgpack payload of an event, without its id (the stream entry id is the id)."""
    if isinstance(event, Unknown):
        return _msgpack_encoder.encode(event.payload)
    return _msgpack_encoder.encode(_strip_id(event))


def encode_json(event: Event) -> bytes:
    """The JSON form (one line, with ``id`` when the event has one)."""
    if isinstance(event, Unknown):
        raw = dict(event.payload)
        if event.id is not None:
            raw = {"kind": raw.get("kind"), "id": event.id, **raw}
        return _json_encoder.encode(raw)
    return _json_encoder.encode(event)


def to_builtins(event: Event) -> dict[str, Any]:
    if isinstance(event, Unknown):
        out = dict(event.payload)
        if event.id is not None:
            out["id"] = event.id
        return out
    result: dict[str, Any] = msgspec.to_builtins(event)
    return result


_ENVELOPE = ("source", "cause", "ts", "agent", "tenant", "trace")


def _unknown(raw: dict[str, Any], event_id: int | None) -> Unknown:
    """Keep a payload whole (its ``id``, from a JSON line, is the entry id, never payload);
    the envelope fields (ts, source, cause…) are lifted from it when they are valid."""
    payload = {k: v for k, v in raw.items() if k != "id"} if "id" in raw else raw
    fields: dict[str, Any] = {"id": event_id, "original_kind": str(raw.get("kind")), "payload": payload}
    envelope = {k: raw[k] for k in _ENVELOPE if k in raw}
    try:
        return msgspec.convert({**envelope, **fields}, Unknown, strict=False)
    except msgspec.ValidationError:
        pass
    valid: dict[str, Any] = {}  # one bad field (a ``ts`` that is not a time) must not cost the others
    for name, value in envelope.items():
        try:
            msgspec.convert({name: value, **fields}, Unknown, strict=False)
        except msgspec.ValidationError:
            continue
        valid[name] = value
    return msgspec.convert({**valid, **fields}, Unknown, strict=False)


def _from_raw(raw: dict[str, Any], event_id: int | None) -> Event:
    """Slow path: upcast an old version, or keep an unknown kind as :class:`Unknown`."""
    kind = raw.get("kind")
    cls = _kinds.get(kind) if isinstance(kind, str) else None
    if cls is None or cls is Unknown:
        return _unknown(raw, event_id)
    version = raw.get("v", 1)
    if not isinstance(version, int) or version > cls.version:
        # Written by a newer riverbed: keep it whole rather than guess.
        return _unknown(raw, event_id)
    while version < cls.version:
        step = _upcasters.get((kind, version))  # type: ignore[arg-type]
        if step is None:
            raise DecodeError(f"no upcaster for {kind} version {version}")
        raw = step(dict(raw))
        version += 1
    raw["v"] = version
    raw.pop("id", None)
    try:
        event = msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise DecodeError(_invalid(kind, exc)) from exc
    return event if event_id is None else with_id(event, event_id)


def decode(payload: bytes, event_id: int | None = None) -> Event:
    """Decode a msgpack payload; raises :class:`DecodeError` when it is not an event."""
    try:
        event: Event = _codecs.msgpack.decode(payload)
    except msgspec.DecodeError:
        try:
            raw = _raw_msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"not a msgpack event payload: {exc}") from exc
        return _from_raw(raw, event_id)
    if event.v != type(event).version:
        return _from_raw(_raw_msgpack.decode(payload), event_id)
    if event_id is not None:
        force_setattr(event, "id", event_id)
    return event


def decode_json(data: bytes | str, *, keep_id: bool = True) -> Event:
    """Decode one JSON object; an unknown kind becomes :class:`Unknown`."""
    try:
        event: Event = _codecs.json.decode(data)
    except msgspec.DecodeError:
        try:
            raw = _raw_json.decode(data)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"not a JSON event object: {exc}") from exc
        raw_id = raw.get("id")
        event = _from_raw(raw, raw_id if isinstance(raw_id, int) and keep_id else None)
    if event.v != type(event).version:
        raw = _raw_json.decode(data)
        event = _from_raw(raw, raw.get("id") if keep_id else None)
    return event if keep_id else _strip_id(event)


def from_builtins(obj: Mapping[str, Any]) -> Event:
    """Build an event given by a user from a dict (``kind`` names the class).

    Stricter than the log's decoders: an unknown kind, a field the kind does not have
    (with a "did you mean" hint), nesting deeper than :data:`MAX_DEPTH` and a value out of
    the schema's bounds are all refused with :class:`DecodeError`.
    """
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise DecodeError("an event needs a string 'kind' field")
    cls = _kinds.get(kind)
    if cls is None or cls is Unknown:
        known = sorted(k for k in _kinds if k != "unknown")
        raise DecodeError(f"unknown event kind {kind!r}{_did_you_mean(kind, known)} (known: {', '.join(known)})")
    fields = set(cls.__struct_fields__)
    for name in obj:
        if name != "kind" and name not in fields:
            raise DecodeError(
                f"{kind} has no field {name!r}{_did_you_mean(name, sorted(fields))} "
                "(`riverbed schema` lists its fields)"
            )
    _check_depth(obj, kind)
    try:
        event: Event = msgspec.convert(obj, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise DecodeError(_invalid(kind, exc)) from exc
    return event


def from_json(data: bytes | str) -> Event:
    """Build an event given by a user from one JSON object, as strictly as :func:`from_builtins`."""
    raw = _user_json(data)
    if not isinstance(raw, dict):
        raise DecodeError(f"an event is a JSON object with a 'kind' field, not a JSON {_json_type(raw)}")
    return from_builtins(raw)


def events_from_json(data: bytes | str) -> list[Event]:
    """Events given by a user as one JSON object or an array of them (see :func:`from_json`)."""
    raw = _user_json(data)
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise DecodeError("the JSON array holds no events")
    out: list[Event] = []
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            where = f" (item {number} of the array)" if isinstance(raw, list) else ""
            raise DecodeError(f"an event is a JSON object with a 'kind' field, not a JSON {_json_type(item)}{where}")
        try:
            out.append(from_builtins(item))
        except DecodeError as exc:
            if not isinstance(raw, list):
                raise
            raise DecodeError(f"item {number} of the array: {exc}") from exc
    return out


def _user_json(data: bytes | str) -> Any:
    try:
        return _any_json.decode(data)
    except RecursionError:
        raise DecodeError(f"the JSON is nested too deeply (events nest at most {MAX_DEPTH} levels)") from None
    except msgspec.DecodeError as exc:
        if isinstance(data, bytes) and "UTF-8" in str(exc):  # (msgspec 0.23 on: its own words, no place)
            try:
                data.decode()
            except UnicodeDecodeError as bad:
                raise _not_utf8(bad) from None
        raise DecodeError(f"not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:  # (msgspec before 0.23 decodes a string's bytes with Python's codec)
        raise _not_utf8(exc) from None


def _not_utf8(exc: UnicodeDecodeError) -> DecodeError:
    return DecodeError(f"not valid JSON: it holds bytes that are not UTF-8 ({exc.reason} at byte {exc.start})")


def check(event: Event, *, max_bytes: int | None = None) -> bytes:
    """The payload of an event given by a user, once it is known to be acceptable.

    Refuses (:class:`DecodeError`, or :class:`~riverbed.errors.InputError` for the size)
    nesting deeper than :data:`MAX_DEPTH`, a value out of the schema's bounds (Python
    constructors do not check them), a payload over ``max_bytes`` and a ``session_config``
    that sets an invalid or reserved environment name.

    The event is encoded once.  Its values are looked at in one pass (:func:`_scan`), which
    vouches for those of the common types (strings, numbers within their bounds, literals,
    times, lists and dicts of them); only an event it cannot vouch for is decoded from its
    payload, as the log's readers will, and refused with the decoder's own words.
    """
    if not isinstance(event, Event):
        raise InputError(f"only events can be appended, not {type(event).__name__}")
    kind = event.original_kind if isinstance(event, Unknown) else event.kind
    vouched = _scan(event, kind)
    try:
        payload = encode(event)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        try:  # a value out of bounds (an int over 64 bits) says so better than the encoder
            msgspec.convert(msgspec.to_builtins(event), type(event), strict=False)
        except (msgspec.ValidationError, TypeError) as invalid:
            if isinstance(invalid, msgspec.ValidationError):
                raise DecodeError(_invalid(kind, invalid)) from exc
        raise DecodeError(f"the {kind} event cannot be encoded: {exc}") from exc
    if max_bytes is not None and len(payload) > max_bytes:
        raise InputError(
            f"the {kind} event is {len(payload):,} bytes encoded, over the limit of {max_bytes:,} "
            "(RIVERBED_MAX_EVENT_BYTES); store large data in a file and refer to it"
        )
    if not vouched and not isinstance(event, Unknown):
        decoded = decode(payload)  # the decoder says what is wrong, in the schema's words
        if isinstance(decoded, Unknown):
            raise DecodeError(f"the {kind} event cannot be read back: {decoded.payload.get('error', 'unknown kind')}")
    if isinstance(event, SessionConfig):
        check_env(event.env)
    return payload


def check_client(event: Event) -> None:
    """Refuse (:class:`~riverbed.errors.SystemEventRefused`) an event a client may not
    append: a kind only the system writes, or a ``source`` the kind does not take from
    clients (:attr:`Event.client_sources`)."""
    allowed = type(event).client_sources
    if event.source in allowed:
        return
    kind = (event.original_kind or "unknown") if isinstance(event, Unknown) else event.kind
    if not allowed:
        raise SystemEventRefused(
            f"a client cannot append a {kind!r} event: only riverbed itself writes them (a role, fork or import)"
        )
    raise SystemEventRefused(
        f"a client cannot append a {kind!r} event with source {event.source!r}: "
        f"clients write it as {' or '.join(repr(s) for s in sorted(allowed))}"
    )


def check_env(env: Mapping[str, str | None]) -> None:
    """Refuse (:class:`DecodeError`) a name that is not a shell identifier or is in
    :data:`RESERVED_ENV`, and a value with a NUL byte."""
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise DecodeError(f"{name!r} is not a valid environment variable name (letters, digits, _)")
        if name in RESERVED_ENV:
            raise DecodeError(
                f"the environment variable {name} is reserved: the sandbox's shell depends on it "
                f"(reserved: {', '.join(sorted(RESERVED_ENV))})"
            )
        if value is not None and "\x00" in value:
            raise DecodeError(f"the value of {name} contains a NUL byte")


_BOUNDS = {
    "timeout": f"a timeout is a finite number of seconds greater than 0 and at most {MAX_TIMEOUT:g}",
    "k": f"k is 1 to {MAX_K}",
    "start": "line numbers start at 1",
    "end": "line numbers start at 1",
    "insert_line": "insert_line is 0 (the top) or a line number",
}


def _invalid(kind: object, exc: msgspec.ValidationError) -> str:
    """One sentence for a field of the wrong type or out of bounds, naming the bound."""
    text = str(exc)
    match = re.search(r"- at `\$\.(\w+)`$", text)
    bound = _BOUNDS.get(match.group(1)) if match and (" > " in text or " >= " in text or " <= " in text) else None
    return f"invalid {kind} event: {text}" + (f" ({bound})" if bound else "")


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


_FLAT = frozenset((str, int, float, bool, bytes, type(None), dt.datetime, msgspec.UnsetType))
"""Types that hold nothing nested (most of an event's fields): never put on the stack."""


def _check_depth(value: Any, kind: str) -> None:
    """Refuse lists and objects nested deeper than :data:`MAX_DEPTH` (without recursing)."""
    if isinstance(value, msgspec.Struct):
        # Most events hold only flat values: looked at in one pass, with no stack.
        nested = [child for child in msgspec.structs.astuple(value) if type(child) not in _FLAT]
        if nested:
            _check_nesting(nested, kind)
    else:
        _check_nesting([value], kind, depth=0)


def _check_nesting(values: list[Any], kind: str, *, depth: int = 1) -> None:
    """:func:`_check_depth` of ``values`` found at ``depth``."""
    stack: list[tuple[Any, int]] = [(child, depth) for child in values]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, msgspec.Struct):
            children: Iterable[Any] = msgspec.structs.astuple(item)
        elif isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple | set | frozenset):
            children = item
        else:
            continue
        if depth >= MAX_DEPTH:
            raise DecodeError(f"the {kind} event nests lists or objects more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children if type(child) not in _FLAT)


_Vouch: TypeAlias = Callable[[Any], "list[Any] | None"]
"""Vouches for a Struct's values (:func:`_voucher`): None when it cannot, else the values that
may nest (those of list, dict, Struct or ``Any`` fields) for the depth check."""


def _scan(event: Event, kind: str) -> bool:
    """One pass over an event's values, for :func:`check`: refuses nesting deeper than
    :data:`MAX_DEPTH` (as :func:`_check_depth`) and says whether every value surely decodes back
    within the schema's bounds, so that the payload need not be decoded to know.

    It vouches only for what it knows the decoder accepts (:func:`_voucher`); anything else (a
    value of another type, a kind with a ``__post_init__``, an unregistered class, another
    version) is left to the decoder, so an event is accepted or refused as decoding it would."""
    cls = type(event)
    nested: list[Any] | None = None
    if _kinds.get(kind) is cls and event.v == cls.version:
        vouch = _vouchers.get(cls)
        if vouch is None:
            vouch = _vouchers[cls] = _voucher(cls)
        nested = vouch(event)
    if nested is None:  # (not vouched for: every value is looked at for nesting)
        _check_depth(event, kind)
        return False
    if nested:
        _check_nesting(nested, kind)
    return True


_vouchers: dict[type[msgspec.Struct], _Vouch] = {}


def _voucher(cls: type[msgspec.Struct]) -> _Vouch:
    """The voucher of a Struct class: one test per field, written out for the class (as
    ``dataclasses`` writes an ``__init__``), since a loop over the fields costs more than
    decoding the payload does.

    A value that is the field's (flat) default, or unset for a field that has one, is not written
    or decodes back as the default.  An event's ``id`` is not in its payload.  A class with a
    ``__post_init__`` (which may refuse a value) is never vouched for."""
    if hasattr(cls, "__post_init__"):
        return _never
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    names = cls.__struct_fields__
    defaults = dict(zip(names[len(names) - len(cls.__struct_defaults__) :], cls.__struct_defaults__, strict=True))
    scope: dict[str, Any] = {"UNSET": msgspec.UNSET, "datetime": dt.datetime, "_vouched": _vouched, "FLAT": _FLAT}
    lines = ["def vouch(event):", "    nested = []"]
    for field in info.fields:
        lines.append(f"    v = event.{field.name}")
        if field.name == "id" and issubclass(cls, Event):
            lines.append("    if type(v) not in FLAT:\n        nested.append(v)")  # (not written; nesting is refused)
            continue
        flat = _flat(field.type)
        test = _test(field.type, "v", scope)
        skip = []
        if not field.required:
            skip.append("v is not UNSET")
            default = defaults.get(field.name, msgspec.NODEFAULT)
            if (
                field.default_factory is msgspec.NODEFAULT
                and type(default) in _FLAT
                and eval(test, scope, {"v": default})  # noqa: S307  (a default out of its bounds is looked at)
            ):
                scope[f"d_{field.name}"] = default
                skip.append(f"v is not d_{field.name}")
        if flat:
            lines.append(f"    if {' and '.join([*skip, f'not ({test})'])}:\n        return None")
        else:
            lines.append(f"    if {' and '.join(skip) or 'True'}:")
            lines.append(f"        if not ({test}):\n            return None")
            lines.append("        nested.append(v)")
    lines.append("    return nested")
    exec("\n".join(lines), scope)  # noqa: S102  (source made above from the class's own field types)
    vouch: _Vouch = scope["vouch"]
    return vouch


def _vouched(value: msgspec.Struct) -> bool:
    """Whether a Struct held in an event is vouched for (its nesting is checked with the event's)."""
    cls = type(value)
    vouch = _vouchers.get(cls)
    if vouch is None:
        vouch = _vouchers[cls] = _voucher(cls)
    return vouch(value) is not None


def _flat(t: Any) -> bool:
    """Whether a value of type ``t`` (``msgspec.inspect``) holds nothing nested."""
    mi = msgspec.inspect
    if isinstance(t, mi.Metadata):
        return _flat(t.type)
    if isinstance(t, mi.UnionType):
        return all(_flat(option) for option in t.types)
    return isinstance(t, mi.NoneType | mi.BoolType | mi.IntType | mi.FloatType | mi.StrType | mi.LiteralType
                      | mi.DateTimeType)  # fmt: skip


def _never(_value: Any) -> None:
    return None


def _test(t: Any, v: str, scope: dict[str, Any]) -> str:
    """A Python expression that is True when ``v`` (an expression) surely decodes as the
    ``msgspec.inspect`` type ``t``; names it needs go into ``scope``.  The types of riverbed's
    kinds, with their bounds; any other type is never vouched for ("False")."""
    mi = msgspec.inspect
    name = f"c{len(scope)}"
    if isinstance(t, mi.Metadata):
        return _test(t.type, v, scope)
    if isinstance(t, mi.AnyType):
        return "True"
    if isinstance(t, mi.NoneType):
        return f"{v} is None"
    if isinstance(t, mi.BoolType):
        return f"type({v}) is bool"
    if isinstance(t, mi.IntType | mi.FloatType):
        if t.multiple_of is not None:
            return "False"
        kinds = f"type({v}) is int" if isinstance(t, mi.IntType) else f"(type({v}) is float or type({v}) is int)"
        # (NaN is within no bound: never vouched for where there is one)
        bounds = [f"{v} {op} {bound!r}" for op, bound in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
                  if bound is not None]  # fmt: skip
        return " and ".join([kinds, *bounds])
    if isinstance(t, mi.StrType):
        parts = [f"type({v}) is str", *_lengths(t, v)]
        if t.pattern is not None:
            scope[name] = re.compile(t.pattern)  # (msgspec searches with Python's re, as here)
            parts.append(f"{name}.search({v}) is not None")
        return " and ".join(parts)
    if isinstance(t, mi.LiteralType):
        scope[name] = frozenset(t.values)
        return f"(type({v}) is str or type({v}) is int) and {v} in {name}"
    if isinstance(t, mi.DateTimeType) and t.tz is None:
        return f"type({v}) is datetime"
    if isinstance(t, mi.UnionType):
        return " or ".join(f"({_test(option, v, scope)})" for option in t.types)
    if isinstance(t, mi.StructType):
        scope[name] = t.cls  # (its voucher is made when first needed: a Struct may hold itself)
        return f"type({v}) is {name} and _vouched({v})"
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.TupleType | mi.DictType):
        item = f"x{len(scope)}"
        scope[name] = None  # (reserves the names)
        if isinstance(t, mi.DictType):
            key = f"k{len(scope)}"
            each = f"({_test(t.key_type, key, scope)}) and ({_test(t.value_type, item, scope)})"
            return " and ".join(
                [f"type({v}) is dict", *_lengths(t, v), f"all({each} for {key}, {item} in {v}.items())"]
            )
        array = f"(type({v}) is list or type({v}) is tuple)"
        if isinstance(t, mi.TupleType):
            items = [f"({_test(each, f'{v}[{i}]', scope)})" for i, each in enumerate(t.item_types)]
            return " and ".join([array, f"len({v}) == {len(items)}", *items])
        return " and ".join([array, *_lengths(t, v), f"all({_test(t.item_type, item, scope)} for {item} in {v})"])
    return "False"


def _lengths(t: Any, v: str) -> list[str]:
    """The tests of a type's ``min_length`` and ``max_length`` (characters of a str, as msgspec counts)."""
    out = []
    if t.min_length is not None:
        out.append(f"len({v}) >= {t.min_length}")
    if t.max_length is not None:
        out.append(f"len({v}) <= {t.max_length}")
    return out


def _codecs_union() -> Any:
    return Union[tuple(_kinds.values())]  # noqa: UP007


def json_schema() -> dict[str, Any]:
    """JSON Schema of every registered kind (a ``oneOf`` discriminated by ``kind``)."""
    schema: dict[str, Any] = msgspec.json.schema(_codecs_union())
    return schema
