// riverbed console: plain JavaScript, no build step, no third-party code.
// Everything from the log is put on the page with textContent, never as HTML.

const $ = (id) => document.getElementById(id);
const STORE = "riverbed.key";
const state = { key: sessionStorage.getItem(STORE), me: null, page: null };

// --- the API ---------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${state.key}`, ...(options.headers ?? {}) };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    ...options,
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  if (!response.ok) {
    const problem = await response.json().catch(() => ({}));
    if (response.status === 401) signOut(problem.detail);
    throw new ApiError(response.status, problem.detail ?? response.statusText);
  }
  return response;
}

// Follow a session's log over SSE (fetch, since EventSource cannot send the key); reconnects
// with Last-Event-ID until `signal` aborts.
async function follow(session, after, onEvents, signal, onLive) {
  let last = after;
  while (!signal.aborted) {
    try {
      const response = await api(`/v1/sessions/${encodeURIComponent(session)}/events`, {
        headers: { Accept: "text/event-stream", "Last-Event-ID": String(last) },
        signal,
      });
      onLive(true);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        const batch = [];
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
          if (data.length) batch.push(JSON.parse(data.join("\n")));
        }
        if (batch.length) {
          last = batch[batch.length - 1].id;
          onEvents(batch);
        }
      }
    } catch (error) {
      if (signal.aborted || error.status === 401 || error.status === 404) return;
    }
    onLive(false);
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

// --- small DOM helpers -----------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function show(section) {
  for (const id of ["login", "sessions", "session"]) $(id).hidden = id !== section;
}

function when(ts) {
  if (!ts) return "";
  const date = new Date(ts);
  return date.toLocaleTimeString([], { hour12: false }) + "." + String(date.getMilliseconds()).padStart(3, "0");
}

function clip(text, n = 400) {
  text = String(text ?? "");
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

// --- sign in ---------------------------------------------------------------------------------

function signOut(reason) {
  sessionStorage.removeItem(STORE);
  state.key = null;
  state.me = null;
  stopPage();
  $("login-error").textContent = reason ?? "";
  $("who").textContent = "";
  $("signout").hidden = true;
  show("login");
}

async function signIn(key) {
  state.key = key;
  try {
    state.me = await (await api("/v1/me")).json();
  } catch (error) {
    if (error.status !== 401) signOut(error.message);
    return false;
  }
  sessionStorage.setItem(STORE, key);
  $("who").textContent = state.me.admin ? `admin${state.me.tenant ? " · " + state.me.tenant : ""}` : `tenant ${state.me.tenant}`;
  $("signout").hidden = false;
  return true;
}

// --- pages -----------------------------------------------------------------------------------

function stopPage() {
  if (state.page) state.page.abort();
  state.page = null;
}

async function route() {
  stopPage();
  const controller = new AbortController();
  state.page = controller;
  if (!state.key || (!state.me && !(await signIn(state.key)))) {
    show("login");
    $("key").focus();
    return;
  }
  const match = location.hash.match(/^#\/s\/(.+)$/);
  if (match) await sessionPage(decodeURIComponent(match[1]), controller.signal);
  else await listPage(controller.signal);
}

async function listPage(signal) {
  show("sessions");
  $("crumbs").textContent = "";
  const render = async () => {
    const { sessions } = await (await api("/v1/sessions", { signal })).json();
    const rows = sessions.map((s) => {
      const roleCells = ["runtime", "memory", "condenser"].flatMap((role) => {
        const r = s.roles[role] ?? {};
        return [
          el("td", { class: "mono", text: r.owner ?? "—" }),
          el("td", { class: "num" + (r.lag > 0 ? " lagging" : ""), text: String(r.lag ?? "") }),
        ];
      });
      return el(
        "tr",
        {},
        el("td", {}, el("a", { href: `#/s/${encodeURIComponent(s.session)}`, text: s.session })),
        el("td", { text: s.tenant ?? "—" }),
        el("td", { class: "num", text: String(s.last) }),
        el("td", { text: s.last_ts ? new Date(s.last_ts).toLocaleString() : "" }),
        ...roleCells,
      );
    });
    $("session-rows").replaceChildren(...rows);
    $("sessions-note").textContent = `${sessions.length} session${sessions.length === 1 ? "" : "s"} · refreshed ${when(new Date().toISOString())}`;
  };
  while (!signal.aborted) {
    try {
      await render();
    } catch (error) {
      if (signal.aborted) return;
      $("sessions-note").textContent = error.message;
    }
    await new Promise((resolve) => setTimeout(resolve, 5000));
  }
}

// --- the session page ------------------------------------------------------------------------

function summary(e) {
  switch (e.kind) {
    case "message": return e.content;
    case "cmd_run": return `$ ${e.command}`;
    case "cmd_output": return e.content;
    case "python_run": return e.code;
    case "python_output": return e.content ?? JSON.stringify(e);
    case "file_read": return e.path;
    case "file_write": return `${e.path} (${(e.content ?? "").length} chars)`;
    case "file_edit": return `${e.command} ${e.path}`;
    case "file_content": return `${e.path}\n${e.content}`;
    case "file_written": return e.path;
    case "file_edited": return `${e.path}\n${e.diff ?? ""}`;
    case "recall": return `${e.recall_type}: ${e.query}`;
    case "recall_result": return (e.hits ?? []).map((h) => `#${h.event_id} ${h.kind} ${Number(h.score).toFixed(2)}  ${h.text}`).join("\n") || `${e.recall_type}: no hits`;
    case "think": return e.thought;
    case "finish": return e.final_thought;
    case "error": return `${e.reason}${e.retryable ? " (retryable)" : ""}: ${e.content}`;
    case "condensation": return e.summary ?? "";
    case "summary": return e.content;
    case "masked": return `[${e.original_kind} hidden] ${e.content}`;
    case "forked": return `forked from ${e.source_session} at event ${e.at}`;
    case "llm_response": return e.content ?? `${(e.tool_calls ?? []).length} tool call(s)`;
    case "context_edit": return [e.op, ...(e.ranges ?? []).map(([a, b]) => (a === b ? `#${a}` : `#${a}–#${b}`)), ...(e.kinds ?? []).map((k) => `kind ${k}`)].join(" ") + (e.note ? ` (${e.note})` : "");
    case "session_config": return Object.keys(e.env ?? {}).map((k) => `${k}=${e.env[k] ?? "(unset)"}`).join(" ") || "settings";
    default: return JSON.stringify(e);
  }
}

const ACTIONS = new Set(["message", "cmd_run", "file_read", "file_write", "file_edit", "python_run", "recall", "condensation_request", "think", "finish"]);
const PRE = new Set(["cmd_output", "python_output", "python_run", "file_content", "file_edited", "recall_result"]);

function category(e) {
  if (e.kind === "error") return "error";
  if (e.kind === "condensation" || e.kind === "summary" || e.kind === "context_edit") return "condensation";
  if (e.kind === "llm_response") return "llm";
  if (ACTIONS.has(e.kind)) return "action";
  if (e.cause != null) return "observation";
  return "system";
}

function body(e) {
  const text = clip(summary(e), 4000);
  if (!text) return null;
  return PRE.has(e.kind) ? el("pre", { text }) : el("p", { class: "text", text });
}

function usage(e) {
  const u = e.usage ?? {};
  const cached = u.prompt_tokens_details?.cached_tokens ?? u.cached_tokens;
  const parts = [
    ["prompt", u.prompt_tokens ?? u.input_tokens],
    ["completion", u.completion_tokens ?? u.output_tokens],
    ["cached", cached],
    ["total", u.total_tokens],
    ["cost $", u.cost],
  ].filter(([, v]) => v != null);
  return el("div", { class: "usage" }, el("span", { text: e.model }), ...parts.map(([k, v]) => el("span", {}, `${k} `, el("b", { text: String(v) }))));
}

class SessionView {
  constructor(session, signal) {
    this.session = session;
    this.signal = signal;
    this.events = new Map(); // id -> event
    this.answers = new Map(); // action id -> observation
    this.hiddenBy = new Map(); // event id -> condensation id
    this.nodes = new Map(); // id -> li of the event (or of its action)
    this.last = 0;
    this.selected = null;
    this.pinned = false; // the slider follows the newest event until the user moves it
    this.timer = null;
    this.pins = new Set(); // pinned event ids (from the context report)
    this.range = null; // [first, last] chosen for a context edit
    this.preview = null; // the body of the edit last previewed
    this.refreshTimer = null;
  }

  // What hides each event and what is pinned now (condensations and user edits alike), and
  // the token usage per step: both from the server, after any batch that can change them.
  refreshSoon() {
    clearTimeout(this.refreshTimer);
    this.refreshTimer = setTimeout(() => this.refresh(), 150);
  }

  async refresh() {
    const path = `/v1/sessions/${encodeURIComponent(this.session)}`;
    try {
      const context = await (await api(`${path}/context`, { signal: this.signal })).json();
      const before = new Map(this.hiddenBy);
      const pinsBefore = this.pins;
      this.hiddenBy = new Map(context.hidden.map((h) => [h.id, h.by]));
      this.pins = new Set(context.pinned);
      const changed = new Set([...before.keys(), ...this.hiddenBy.keys(), ...pinsBefore, ...this.pins]);
      for (const id of changed) if (before.get(id) !== this.hiddenBy.get(id) || pinsBefore.has(id) !== this.pins.has(id)) this.rerender(id);
      const used = await (await api(`${path}/usage`, { signal: this.signal })).json();
      const money = (c) => (c == null ? "" : c.toFixed(6));
      const rows = used.steps.map((s) => el("tr", {}, el("td", { class: "num", text: `#${s.event_id}` }), el("td", { text: s.model }), el("td", { class: "num", text: String(s.prompt_tokens) }), el("td", { class: "num", text: String(s.cached_tokens) }), el("td", { class: "num", text: String(s.completion_tokens) }), el("td", { class: "num", text: money(s.cost) })));
      if (used.steps.length) rows.push(el("tr", { class: "total" }, el("td", { text: "total" }), el("td", { text: `${used.steps.length} calls` }), el("td", { class: "num", text: String(used.prompt_tokens) }), el("td", { class: "num", text: String(used.cached_tokens) }), el("td", { class: "num", text: String(used.completion_tokens) }), el("td", { class: "num", text: money(used.cost) })));
      else rows.push(el("tr", {}, el("td", { colspan: "6", class: "muted", text: "no model calls in this session" })));
      $("usage-rows").replaceChildren(...rows);
    } catch (error) {
      if (!this.signal.aborted) $("ctx-result").textContent = error.message;
    }
  }

  choose(id, extend) {
    const [first] = extend && this.range ? this.range : [id];
    this.range = [Math.min(first, id), Math.max(first, id)];
    $("ctx-from").value = String(this.range[0]);
    $("ctx-to").value = String(this.range[1]);
    this.clearPreview();
  }

  editBody(dryRun) {
    const from = Number($("ctx-from").value);
    const to = Number($("ctx-to").value || $("ctx-from").value);
    const kind = $("ctx-kind").value;
    const body = { op: $("ctx-op").value, ranges: from ? [[from, Math.max(from, to)]] : [], kinds: kind ? [kind] : [], dry_run: dryRun };
    const note = $("ctx-note").value.trim();
    if (note) body.note = note;
    return body;
  }

  clearPreview() {
    this.preview = null;
    $("ctx-apply").disabled = true;
    for (const li of $("timeline").querySelectorAll(".would-hide, .would-show")) li.classList.remove("would-hide", "would-show");
  }

  describe(change, verb) {
    const list = (ids) => ids.map((i) => `#${i}`).join(", ");
    const parts = [
      [verb === "would" ? "would hide" : "hid", change.hidden],
      [verb === "would" ? "would show again" : "showed again", change.shown],
      [verb === "would" ? "would pin" : "pinned", change.pinned],
      [verb === "would" ? "would unpin" : "unpinned", change.unpinned],
    ].filter(([, ids]) => ids.length).map(([what, ids]) => `${what} ${ids.length} event${ids.length === 1 ? "" : "s"} (${list(ids)})`);
    return parts.join("; ") || (verb === "would" ? "would change nothing" : "changed nothing");
  }

  async previewEdit() {
    this.clearPreview();
    const body = this.editBody(true);
    try {
      const change = await (await api(`/v1/sessions/${encodeURIComponent(this.session)}/context`, { method: "POST", body })).json();
      $("ctx-result").textContent = `${body.op} as edit #${change.edit}: ${this.describe(change, "would")}`;
      for (const [ids, cls] of [[change.hidden, "would-hide"], [change.shown, "would-show"]]) for (const id of ids) this.nodes.get(id)?.classList.add(cls);
      this.preview = { ...body, dry_run: false };
      $("ctx-apply").disabled = false;
    } catch (error) {
      $("ctx-result").textContent = error.message;
    }
  }

  async applyEdit() {
    if (!this.preview) return;
    const body = this.preview;
    this.clearPreview();
    try {
      const change = await (await api(`/v1/sessions/${encodeURIComponent(this.session)}/context`, { method: "POST", body })).json();
      $("ctx-result").textContent = `applied edit #${change.edit} (${body.op}): ${this.describe(change, "did")}`;
    } catch (error) {
      $("ctx-result").textContent = error.message;
    }
  }

  add(batch) {
    for (const e of batch) {
      this.events.set(e.id, e);
      this.last = Math.max(this.last, e.id);
      if (e.kind === "condensation") {
        for (const [start, end] of e.forgotten ?? []) {
          for (let id = start; id <= Math.min(end, e.id - 1); id++) if (!this.hiddenBy.has(id)) this.hiddenBy.set(id, e.id);
        }
      }
      const action = e.cause != null ? this.events.get(e.cause) : undefined;
      if (action && ACTIONS.has(action.kind) && !ACTIONS.has(e.kind) && e.kind !== "condensation" && !this.answers.has(e.cause)) {
        this.answers.set(e.cause, e);
        this.nodes.set(e.id, this.nodes.get(e.cause));
        this.rerender(e.cause);
      } else {
        const li = this.card(e);
        this.nodes.set(e.id, li);
        $("timeline").append(li);
      }
      if (e.kind === "condensation") for (const id of this.hiddenBy.keys()) if (this.hiddenBy.get(id) === e.id) this.rerender(id);
    }
    this.refreshSoon();
    $("session-meta").textContent = `${this.tenantText} · ${this.last} events`;
    const slider = $("slider");
    slider.max = String(Math.max(1, this.last));
    if (!this.pinned) this.select(this.last, false);
    else this.shade();
  }

  rerender(id) {
    const old = this.nodes.get(id);
    const e = this.events.get(id);
    if (!old || !e || old.dataset.id !== String(id)) return;
    const fresh = this.card(e);
    old.replaceWith(fresh);
    for (const [key, node] of this.nodes) if (node === old) this.nodes.set(key, fresh);
    this.shade();
  }

  card(e) {
    const hidden = this.hiddenBy.get(e.id);
    const classes = ["ev", category(e)];
    if (hidden) classes.push("hidden-by");
    if (this.pins.has(e.id)) classes.push("pinned");
    const head = el(
      "div",
      { class: "head" },
      el("span", { class: "id", text: `#${e.id}` }),
      el("span", { class: "kind", text: e.kind === "unknown" ? `?${e.original_kind}` : e.kind }),
      el("span", { class: "src", text: e.source }),
      hidden ? el("span", { class: "badge cond", text: `hidden by #${hidden}` }) : null,
      el("span", { class: "ts", text: when(e.ts) }),
      el("button", { class: "link fork-here", type: "button", text: "fork here", title: `fork this session at event ${e.id}`, onclick: (ev) => { ev.stopPropagation(); this.select(e.id, true); $("fork-into").focus(); } }),
    );
    const li = el("li", { class: classes.join(" "), "data-id": String(e.id), onclick: (ev) => { this.choose(e.id, ev.shiftKey); this.select(e.id, true); } }, head, body(e));
    if (e.kind === "llm_response") li.append(usage(e));
    if (e.kind === "condensation") {
      const ranges = (e.forgotten ?? []).map(([a, b]) => (a === b ? `#${a}` : `#${a}–#${b}`)).join(", ");
      const count = [...this.hiddenBy.values()].filter((c) => c === e.id).length;
      li.insertBefore(el("p", { class: "text", text: `hid ${count} event${count === 1 ? "" : "s"} (${ranges || "none"}) from the context${e.summary ? "; summary:" : ""}` }), li.children[1] ?? null);
    }
    const answer = this.answers.get(e.id);
    if (answer) {
      const exit = answer.exit_code != null ? el("span", { class: "badge" + (answer.exit_code ? " bad" : ""), text: `exit ${answer.exit_code}` }) : null;
      li.append(
        el(
          "div",
          { class: "answer" + (answer.kind === "error" ? " error" : "") },
          el("div", { class: "head" }, el("span", { class: "id", text: `#${answer.id}` }), el("span", { class: "kind", text: answer.kind }), exit, el("span", { class: "ts", text: when(answer.ts) })),
          body(answer),
        ),
      );
    }
    return li;
  }

  select(id, byUser) {
    if (byUser) this.pinned = id !== this.last;
    this.selected = id;
    $("slider").value = String(id);
    $("at").textContent = String(id);
    $("fork-at").textContent = String(id);
    if (byUser || !$("fork-into").value) $("fork-into").value = `${this.session}-fork-${id}`.slice(0, 128);
    this.shade(true);
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.loadView(), 120);
  }

  shade(scroll = false) {
    const node = this.nodes.get(this.selected); // an observation's node is its action's card
    for (const li of $("timeline").children) {
      const id = Number(li.dataset.id);
      li.classList.toggle("selected", li === node);
      li.classList.toggle("after", this.selected != null && id > this.selected);
    }
    if (scroll && node) node.scrollIntoView({ block: "nearest" });
  }

  // Recall search over this session's indexed events (GET /recall: appends nothing). A hit
  // travels to its event, as a click on the timeline does.
  async search(query) {
    $("search-note").textContent = "searching…";
    $("search-clear").hidden = false;
    const path = `/v1/sessions/${encodeURIComponent(this.session)}/recall?k=8&q=${encodeURIComponent(query)}`;
    try {
      const { hits } = await (await api(path, { signal: this.signal })).json();
      $("search-note").textContent = hits.length
        ? `${hits.length} hit${hits.length === 1 ? "" : "s"}, best first; click one to travel to it`
        : "no hits (an event is searchable once a memory worker has indexed it)";
      $("search-hits").replaceChildren(
        ...hits.map((h) =>
          el(
            "li",
            { "data-id": String(h.event_id), title: clip(h.text, 2000), onclick: () => { this.choose(h.event_id, false); this.select(h.event_id, true); } },
            el("span", { class: "id", text: `#${h.event_id}` }),
            el("span", { class: "kind", text: h.kind }),
            el("span", { class: "score", text: h.score.toFixed(3) }),
            el("span", { class: "text", text: clip(h.text, 300) }),
          ),
        ),
      );
    } catch (error) {
      $("search-hits").replaceChildren();
      if (!this.signal.aborted) $("search-note").textContent = error.message;
    }
  }

  async loadView() {
    const until = this.selected;
    const mode = document.querySelector('input[name="mode"]:checked').value;
    const path = `/v1/sessions/${encodeURIComponent(this.session)}`;
    let items;
    let note;
    try {
      if (mode === "full") {
        const text = await (await api(`${path}/events?until=${until}`, { signal: this.signal })).text();
        items = text.split("\n").filter(Boolean).map((line) => JSON.parse(line));
        note = `the full log: ${items.length} events up to #${until}`;
      } else {
        const view = await (await api(`${path}/view?until=${until}`, { signal: this.signal })).json();
        items = view.events;
        const shown = items.filter((e) => e.id != null).length;
        note = `${shown} of ${until} events in the context` + (view.summary_index != null ? `, a summary at position ${view.summary_index + 1}` : "");
      }
    } catch (error) {
      if (!this.signal.aborted) $("view-note").textContent = error.message;
      return;
    }
    if (until !== this.selected) return; // the slider moved on meanwhile
    $("view-note").textContent = note;
    $("view").replaceChildren(
      ...items.map((e) =>
        el(
          "li",
          { class: e.kind === "summary" ? "summary" : "", title: clip(summary(e), 2000) },
          el("span", { class: "id", text: e.id != null ? `#${e.id}` : "" }),
          el("span", { class: "kind", text: e.kind === "summary" ? `summary (#${e.cause})` : e.kind }),
          el("span", { class: "text", text: clip(summary(e), 300) }),
        ),
      ),
    );
  }
}

async function sessionPage(session, signal) {
  show("session");
  $("session-title").textContent = session;
  $("session-meta").textContent = "";
  $("timeline").replaceChildren();
  $("view").replaceChildren();
  $("view-note").textContent = "";
  $("fork-result").textContent = "";
  $("fork-into").value = "";
  $("ctx-from").value = "";
  $("ctx-to").value = "";
  $("ctx-note").value = "";
  $("ctx-kind").value = "";
  $("ctx-apply").disabled = true;
  $("usage-rows").replaceChildren();
  clearSearch();
  $("crumbs").replaceChildren(el("a", { href: "#/", text: "sessions" }), ` / ${session}`);
  const view = new SessionView(session, signal);
  state.view = view;
  try {
    const { sessions } = await (await api("/v1/sessions", { signal })).json();
    const info = sessions.find((s) => s.session === session);
    view.tenantText = info ? `tenant ${info.tenant ?? "—"}` : "";
  } catch {
    view.tenantText = "";
  }
  const live = (on) => $("live").classList.toggle("on", on);
  await follow(session, 0, (batch) => view.add(batch), signal, live);
  live(false);
}

// --- wiring ----------------------------------------------------------------------------------

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.me = null;
  if (await signIn($("key").value.trim())) {
    $("key").value = "";
    route();
  } else {
    $("login-error").textContent ||= "that key was not accepted";
  }
});
$("signout").addEventListener("click", () => signOut());
$("slider").addEventListener("input", () => {
  state.view?.select(Number($("slider").value), true);
  state.view?.choose(Number($("slider").value), false);
});
for (const id of ["ctx-op", "ctx-from", "ctx-to", "ctx-kind", "ctx-note"]) $(id).addEventListener("input", () => state.view?.clearPreview());
$("ctx-preview").addEventListener("click", () => state.view?.previewEdit());
$("ctx-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.view?.applyEdit();
});
for (const kind of ["error", "cmd_run", "cmd_output", "think", "message", "recall", "recall_result", "python_run", "python_output", "file_read", "file_content", "file_write", "file_written", "file_edit", "file_edited", "llm_response"]) $("ctx-kind").append(el("option", { value: kind, text: kind }));
for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", () => state.view?.loadView());
$("fork-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const view = state.view;
  if (!view) return;
  const into = $("fork-into").value.trim();
  try {
    const result = await (await api(`/v1/sessions/${encodeURIComponent(view.session)}/fork`, { method: "POST", body: { at: view.selected, into } })).json();
    $("fork-result").replaceChildren("forked: ", el("a", { href: `#/s/${encodeURIComponent(result.session)}`, text: result.session }));
  } catch (error) {
    $("fork-result").textContent = error.message;
  }
});
function clearSearch() {
  $("search-q").value = "";
  $("search-note").textContent = "";
  $("search-hits").replaceChildren();
  $("search-clear").hidden = true;
}
$("search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const query = $("search-q").value.trim();
  if (query) state.view?.search(query);
});
$("search-clear").addEventListener("click", clearSearch);
window.addEventListener("hashchange", route);
route();
