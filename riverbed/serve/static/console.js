// riverbed console: plain JavaScript, no build step, no third-party code.
// Everything from the log is put on the page with textContent, never as HTML.

const $ = (id) => document.getElementById(id);
const STORE = "riverbed.key";
const state = { key: sessionStorage.getItem(STORE), me: null, page: null, view: null };
const LONG_CHARS = 1200; // an output longer than this (or LONG_LINES lines) shows folded, with "show all"
const LONG_LINES = 14;
const MAX_TEXT = 200_000; // the most characters of one field put on the page
const STATUSES = ["running", "finished", "step limit", "budget exhausted", "cancelled", "error", "open"];
const RUN_STATES = ["running", "waiting", "finished", "failed", "cancelled"];
const RUN_ENDS = new Set(["step_limit", "budget_exhausted", "cancelled", "llm_error", "stuck"]); // an agent error with one ends its run

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

const sessionPath = (session) => `/v1/sessions/${encodeURIComponent(session)}`;
const sessionHref = (session) => `#/s/${encodeURIComponent(session)}`;

// Follow a session's log over SSE (fetch, since EventSource cannot send the key); reconnects
// with Last-Event-ID until `signal` aborts.
async function follow(session, after, onEvents, signal, onLive = () => {}) {
  let last = after;
  while (!signal.aborted) {
    try {
      const response = await api(`${sessionPath(session)}/events`, {
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
    if (value == null) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function show(section) {
  for (const id of ["login", "sessions", "session", "runs", "approvals"]) $(id).hidden = id !== section;
}

// One time format everywhere: UTC, to the second (the full instant in the title).
function when(ts) {
  if (ts == null || ts === "") return "";
  const date = ts instanceof Date ? ts : new Date(typeof ts === "number" && ts < 1e11 ? ts * 1000 : ts);
  if (Number.isNaN(date.getTime())) return "";
  return date.toISOString().slice(0, 19).replace("T", " ") + "Z";
}

function timeEl(ts, cls) {
  const text = when(ts);
  if (!text) return el("span", { class: cls });
  const iso = new Date(typeof ts === "number" && ts < 1e11 ? ts * 1000 : ts).toISOString();
  return el("time", { class: cls, datetime: iso, title: iso, text });
}

function clip(text, n = 400) {
  text = String(text ?? "");
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const count = (n) => Number(n ?? 0).toLocaleString("en-US");
// One way to show money everywhere: "—" when the model has no price (RIVERBED_PRICES), else dollars.
const UNPRICED = "no price for this model: set RIVERBED_PRICES to count its cost";
const money = (cost, digits = 4) => (cost == null ? "—" : `$${Number(cost).toFixed(digits)}`);
function moneyCell(cost, digits = 4) {
  return el("td", { class: "num", text: money(cost, digits), title: cost == null ? UNPRICED : null });
}
const ranges = (list) => (list ?? []).map(([a, b]) => (a === b ? `#${a}` : `#${a}–#${b}`)).join(", ");
const stop = (ev) => ev.stopPropagation();

// A block of output; a long one shows folded, with a button that shows all of it.
function block(text, label, cls = "") {
  text = clip(text, MAX_TEXT);
  const lines = text.split("\n").length;
  const long = text.length > LONG_CHARS || lines > LONG_LINES;
  const pre = el("pre", { class: `${cls}${long ? " long" : ""}`.trim() || null, text });
  const node = el("div", { class: "block" }, label ? el("span", { class: "label", text: label }) : null, pre);
  if (long) {
    const more = `show all ${plural(lines, "line")}`;
    node.append(
      el("button", {
        type: "button",
        class: "link expand",
        text: more,
        onclick: (ev) => {
          ev.stopPropagation();
          ev.currentTarget.textContent = pre.classList.toggle("open") ? "show less" : more;
        },
      }),
    );
  }
  return node;
}

const para = (text, cls = "text") => el("p", { class: cls, text: clip(text, MAX_TEXT) });

function raw(e) {
  return el("details", { class: "raw", onclick: stop }, el("summary", { text: "raw JSON" }), el("pre", { text: JSON.stringify(e, null, 2) }));
}

function link(session) {
  return el("a", { href: sessionHref(session), text: session, onclick: stop });
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
  state.view = null;
}

function hashParams() {
  return new URLSearchParams(location.hash.split("?")[1] ?? "");
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
  const match = location.hash.match(/^#\/s\/([^?]+)$/);
  if (match) await sessionPage(decodeURIComponent(match[1]), controller.signal);
  else if (location.hash.startsWith("#/runs")) await runsPage(controller.signal);
  else if (location.hash.startsWith("#/approvals")) await approvalsPage(controller.signal);
  else await listPage(controller.signal);
}

async function every(seconds, signal, work, onError) {
  while (!signal.aborted) {
    try {
      await work();
    } catch (error) {
      if (signal.aborted) return;
      onError(error);
    }
    await new Promise((resolve) => setTimeout(resolve, seconds * 1000));
  }
}

// --- the session list ------------------------------------------------------------------------

function statusBadge(status) {
  return el("span", { class: `status st-${String(status).replace(/ /g, "-")}`, text: status });
}

async function listPage(signal) {
  show("sessions");
  $("crumbs").textContent = "";
  const params = hashParams();
  const limit = Math.min(200, Math.max(1, Number(params.get("limit")) || 25));
  const offset = Math.max(0, Number(params.get("offset")) || 0);
  $("list-q").value = params.get("q") ?? "";
  $("list-tenant").value = params.get("tenant") ?? "";
  $("list-status").value = params.get("status") ?? "";
  const query = new URLSearchParams({ limit: String(limit), offset: String(offset) });
  for (const name of ["q", "tenant", "status"]) if (params.get(name)) query.set(name, params.get(name));
  const go = (newOffset) => {
    const next = new URLSearchParams(params);
    next.set("offset", String(Math.max(0, newOffset)));
    location.hash = `#/?${next}`;
  };
  $("list-prev").onclick = () => go(offset - limit);
  const render = async () => {
    const page = await (await api(`/v1/sessions?${query}`, { signal })).json();
    const rows = page.sessions.map((s) => {
      // One line per role: its owner (cut to the column, whole in the title) and its lag.
      const roleLines = ["runtime", "memory", "condenser"].map((role) => {
        const r = s.roles[role] ?? {};
        const behind = r.lag ?? 0;
        return el(
          "div",
          { class: "role", "data-role": role, title: `${role}: ${r.owner ? `owned by ${r.owner}` : "no owner"}, ${plural(behind, "event")} behind` },
          el("span", { class: "role-name", text: role }),
          el("span", { class: "owner mono", text: r.owner ?? "—" }),
          el("span", { class: "lag" + (behind > 0 ? " lagging" : ""), text: r.lag == null ? "" : String(r.lag) }),
        );
      });
      return el(
        "tr",
        { "data-session": s.session },
        el("td", { class: "session", title: s.session }, el("a", { href: sessionHref(s.session), text: s.session })),
        el("td", {}, statusBadge(s.status)),
        el("td", { class: "task", title: s.task ?? "", text: clip(s.task ?? "—", 90) }),
        el("td", { text: s.tenant ?? "—" }),
        el("td", { class: "num", text: String(s.last) }),
        el("td", { class: "times" }, el("div", {}, timeEl(s.created_ms)), el("div", {}, timeEl(s.last_ts))),
        el("td", { class: "roles" }, ...roleLines),
      );
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "7", class: "muted", text: "no sessions match" })));
    $("session-rows").replaceChildren(...rows);
    const shown = page.sessions.length;
    const span = shown ? `${offset + 1}–${offset + shown}` : "none";
    $("list-page").textContent = `${span} of ${page.total ?? "more"}, newest first`;
    $("list-prev").disabled = offset === 0;
    $("list-next").disabled = page.next_offset == null;
    $("list-next").onclick = () => go(page.next_offset);
    $("sessions-note").replaceChildren(`refreshed `, timeEl(new Date()));
  };
  await every(5, signal, render, (error) => ($("sessions-note").textContent = error.message));
}

// --- the runs page ---------------------------------------------------------------------------

async function runsPage(signal) {
  show("runs");
  $("crumbs").textContent = "";
  const wanted = hashParams().get("state") ?? "";
  $("runs-state").value = wanted;
  const render = async () => {
    const path = `/v1/runs${wanted ? `?state=${encodeURIComponent(wanted)}` : ""}`;
    const { runs } = await (await api(path, { signal })).json();
    const rows = runs.map((r) =>
      el(
        "tr",
        { "data-session": r.session },
        el("td", { class: "session", title: r.session }, el("a", { href: sessionHref(r.session), text: r.session })),
        el("td", { class: "tree" }, ...treeCell(r)),
        el("td", { text: r.tenant ?? "—" }),
        el("td", {}, el("span", { class: `status run-${r.state}`, text: r.state + (r.reason && r.state !== "finished" && r.reason !== r.state ? ` (${r.reason})` : "") })),
        el("td", { class: "num", text: String(r.steps ?? 0) }),
        el("td", { class: "num tokens", text: count(r.tokens), title: "its own model calls and its sub-agents'" }),
        moneyCell(r.cost),
        el("td", { class: "mono", text: r.worker ?? "—" }),
        el("td", {}, timeEl(r.started_at ?? r.opened_at ?? (r.age != null ? Date.now() / 1000 - r.age : null))),
        el("td", {}, r.state === "running" || r.state === "waiting" ? el("button", { type: "button", class: "cancel", text: "cancel", onclick: (ev) => cancelRun(r.session, ev.currentTarget, $("runs-note")) }) : null),
      ),
    );
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "10", class: "muted", text: wanted ? `no ${wanted} runs` : "no runs yet: start one with riverbed agent S \"task\" --detach" })));
    $("run-rows").replaceChildren(...rows);
    $("runs-refreshed").replaceChildren(`${plural(runs.length, "run")} · refreshed `, timeEl(new Date()));
  };
  await every(2, signal, render, (error) => {
    $("runs-note").textContent = error.status === 404 || error.status === 405 ? "this server has no runs route (GET /v1/runs)" : error.message;
  });
}

// Where a run sits in a delegation tree: the parent of a sub-agent's run, the sub-agents of a parent's.
function treeCell(r) {
  const parts = [];
  if (r.parent) parts.push("sub-agent of ", link(r.parent));
  const children = r.children ?? [];
  if (children.length) parts.push(parts.length ? " · " : "", el("span", { title: children.join("\n"), text: plural(children.length, "sub-agent") }));
  return parts.length ? parts : ["—"];
}

async function cancelRun(session, button, note) {
  if (button) button.disabled = true;
  try {
    await api(`${sessionPath(session)}/runs/cancel`, { method: "POST", body: {} });
    note.textContent = `asked the agent to cancel the run of ${session}`;
  } catch (error) {
    note.textContent = error.message;
    if (button) button.disabled = false;
  }
}

// --- approvals: calls that wait for a person ---------------------------------------------------

// Approve and Reject for one waiting call; Reject opens a small form for an optional reason.
// All of it is text (a reason or arguments come from a model's output).
function decisionControls(session, action) {
  const note = el("span", { class: "decide-note muted", role: "status" });
  const reason = el("input", { class: "reject-reason", maxlength: "4000", size: "34", placeholder: "why (optional; the model reads it)", "aria-label": `why reject call #${action}` });
  const send = el("button", { type: "submit", class: "reject-send", text: "Reject the call" });
  const back = el("button", { type: "button", class: "link", text: "keep waiting" });
  const form = el("form", { class: "reject-form", hidden: "" }, reason, send, back);
  const approve = el("button", { type: "button", class: "approve", text: "Approve" });
  const reject = el("button", { type: "button", class: "reject", text: "Reject" });
  const decide = async (decision, why) => {
    for (const button of [approve, reject, send]) button.disabled = true;
    note.textContent = decision === "approve" ? "approving…" : "rejecting…";
    try {
      await api(`${sessionPath(session)}/approvals`, { method: "POST", body: { decision, actions: [action], reason: why } });
      note.textContent = decision === "approve" ? "approved: the call runs now" : "rejected: the model reads why";
      form.hidden = true;
    } catch (error) {
      note.textContent = error.message;
      for (const button of [approve, reject, send]) button.disabled = false;
    }
  };
  approve.addEventListener("click", () => decide("approve", ""));
  reject.addEventListener("click", () => {
    form.hidden = false;
    reject.hidden = true;
    reason.focus();
  });
  back.addEventListener("click", () => {
    form.hidden = true;
    reject.hidden = false;
  });
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    decide("reject", reason.value.trim());
  });
  return el("div", { class: "decide", "data-action": String(action), onclick: stop }, approve, reject, form, note);
}

function riskBadge(level) {
  return el("span", { class: `badge risk risk-${String(level).replace(/[^a-z]/g, "")}`, text: `${level} risk` });
}

// The calls of GET /v1/approvals, refreshed every 2 s. A row stays the same node while its call
// waits, so a reason being typed is not lost to a refresh.
async function approvalsPage(signal) {
  show("approvals");
  $("crumbs").textContent = "";
  $("approvals-note").textContent = "";
  const rows = new Map(); // "session#action" -> tr
  const render = async () => {
    const { approvals } = await (await api("/v1/approvals", { signal })).json();
    const wanted = approvals.map((a) => {
      const key = `${a.session}#${a.action}`;
      if (!rows.has(key)) {
        let args = a.arguments ?? "";
        try {
          args = JSON.stringify(JSON.parse(args), null, 2);
        } catch {
          // cut at 500 characters by the server, or not JSON: shown as it is
        }
        rows.set(
          key,
          el(
            "tr",
            { "data-session": a.session, "data-action": String(a.action) },
            el("td", { class: "session", title: a.session }, el("a", { href: sessionHref(a.session), text: a.session })),
            el("td", { text: a.tenant ?? "—" }),
            el("td", { class: "num", text: `#${a.action}` }),
            el("td", { class: "call-name", text: a.tool }),
            el("td", { class: "args" }, el("pre", { text: clip(args, 2000) })),
            el("td", { class: "why" }, riskBadge(a.level), el("div", { class: "risk-reason", text: clip(a.reason, 2000) })),
            el("td", {}, timeEl(a.since)),
            el("td", { class: "decide-cell" }, decisionControls(a.session, a.action)),
          ),
        );
      }
      return key;
    });
    for (const key of [...rows.keys()]) if (!wanted.includes(key)) rows.delete(key);
    const body = $("approval-rows");
    const shown = [...body.children].map((tr) => tr.dataset.key);
    if (shown.join("\n") !== wanted.join("\n") || !wanted.length) {
      const trs = wanted.map((key) => rows.get(key));
      for (const [i, tr] of trs.entries()) tr.dataset.key = wanted[i];
      if (!trs.length) trs.push(el("tr", {}, el("td", { colspan: "8", class: "muted", text: "no call waits for approval (a run opened with confirm never, the default, asks for none)" })));
      body.replaceChildren(...trs);
    }
    $("approvals-refreshed").replaceChildren(`${plural(approvals.length, "call")} waiting · refreshed `, timeEl(new Date()));
  };
  await every(2, signal, render, (error) => {
    $("approvals-note").textContent = error.status === 404 || error.status === 405 ? "this server has no approvals route (GET /v1/approvals)" : error.message;
  });
}

// --- the session page: how each event reads --------------------------------------------------

// A kind the server does not know reads back with its own kind and fields (the raw payload).
function summary(e) {
  switch (e.kind) {
    case "message": return e.content;
    case "cmd_run": return `$ ${e.command}`;
    case "cmd_output": return e.content;
    case "python_run": return e.code;
    case "python_output": return [e.content, e.result != null ? `→ ${e.result}` : null, e.exception].filter(Boolean).join("\n") || "(no output)";
    case "file_read": return e.path;
    case "file_write": return `${e.path} (${(e.content ?? "").length} chars)`;
    case "file_edit": return `${e.command} ${e.path}`;
    case "file_content": return `${e.path}\n${e.content}`;
    case "file_written": return e.path;
    case "file_edited": return `${e.path}\n${e.diff ?? ""}`;
    case "recall": return `${e.recall_type}: ${e.query}`;
    case "recall_result": return (e.hits ?? []).map((h) => `#${h.event_id} ${h.kind}  ${h.text}`).join("\n") || `${e.recall_type}: no hits`;
    case "think": return e.thought;
    case "finish": return e.final_thought;
    case "error": return e.source === "agent" && RUN_ENDS.has(e.reason) ? `${e.reason}, the run ended: ${e.content}` : `${e.reason}${e.retryable ? " (retryable)" : ""}: ${e.content}`;
    case "condensation": return e.summary ?? `hid ${ranges(e.forgotten) || "nothing"}`;
    case "condensation_request": return "asked the condenser to condense now";
    case "summary": return e.content;
    case "masked": return `[${e.original_kind} hidden] ${e.content}`;
    case "forked": return `forked from ${e.source_session} at event ${e.at} (${e.workspace ?? "empty"})`;
    case "sandbox_rebuilt": return `sandbox rebuilt (${e.method}): ${plural(e.actions ?? 0, "action")} re-run, ${plural((e.differences ?? []).length, "divergence")}`;
    case "llm_response": return [e.content, ...(e.tool_calls ?? []).map((c) => `${c.function?.name ?? "?"}(${c.function?.arguments ?? ""})`)].filter(Boolean).join("\n") || "(empty response)";
    case "context_edit": return [e.op, ranges(e.ranges), ...(e.kinds ?? []).map((k) => `kind ${k}`)].filter(Boolean).join(" ") + (e.note ? ` (${e.note})` : "");
    case "session_config": return configLines(e).join("; ") || "no change";
    case "run_started": return `run opened: ${runLimits(e)}`;
    case "run_cancel": return `asked the agent to cancel the run${e.note ? `: ${e.note}` : ""}`;
    case "run_paused": return `paused the run${e.note ? `: ${e.note}` : ""}`;
    case "run_resumed": return `resumed the run${e.note ? `: ${e.note}` : ""}`;
    case "approval": return `${e.decision === "approve" ? "approved" : "rejected"} ${(e.actions ?? []).map((a) => `#${a}`).join(", ")}${e.by ? ` (by ${e.by})` : ""}${e.reason ? `: ${e.reason}` : ""}`;
    case "delegate": return e.task ?? "";
    case "delegated": return `sub-agent of ${e.parent} (its action #${e.parent_action})`;
    case "delegate_result": return `${e.session}: ${e.content ?? ""}`;
    default: return JSON.stringify(e);
  }
}

function runLimits(e) {
  return [
    e.model ? `model ${e.model}` : "the worker's model",
    `at most ${plural(e.max_steps ?? 30, "step")}`,
    e.max_tokens != null ? `${e.max_tokens} tokens` : null,
    e.max_cost != null ? `$${e.max_cost}` : null,
  ].filter(Boolean).join(", ");
}

function configLines(e) {
  const lines = Object.entries(e.env ?? {}).map(([k, v]) => (v == null ? `unset ${k}` : `set ${k}=${v}`));
  if (e.condenser) {
    const c = e.condenser;
    const fields = Object.entries(c).filter(([k]) => k !== "strategy" && k !== "stages").map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`);
    lines.push(`condenser ${c.strategy ?? "(default)"}${fields.length ? ": " + fields.join(", ") : ""}`);
    for (const [i, stage] of (c.stages ?? []).entries()) lines.push(`  stage ${i + 1}: ${stage.strategy ?? "?"} ${Object.entries(stage).filter(([k]) => k !== "strategy").map(([k, v]) => `${k} ${v}`).join(", ")}`);
  }
  return lines;
}

function toolCalls(calls) {
  return (calls ?? []).map((call) => {
    const fn = call.function ?? {};
    let args = fn.arguments ?? "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // not JSON: shown as the model wrote it
    }
    return el("div", { class: "call" }, el("span", { class: "call-name", text: fn.name ?? "?" }), call.id ? el("span", { class: "muted", text: ` ${call.id}` }) : null, block(args, null, "args"));
  });
}

function divergences(list) {
  if (!list?.length) return null;
  return el(
    "table",
    { class: "grid small divergences" },
    el("thead", {}, el("tr", {}, ...["action", "kind", "field", "recorded", "now"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...list.map((d) => el("tr", {}, el("td", { text: `#${d.action_id}` }), el("td", { text: d.kind }), el("td", { text: d.field }), el("td", { class: "mono", text: clip(JSON.stringify(d.recorded), 200) }), el("td", { class: "mono", text: clip(JSON.stringify(d.new), 200) })))),
  );
}

function rebuilt(e) {
  const n = (e.differences ?? []).length;
  const how = { replay: `re-ran ${plural(e.actions ?? 0, "recorded action")}`, copy: "copied the source's workspace", empty: "started empty" }[e.method] ?? e.method;
  return [
    para(`built the sandbox as of #${e.at} (${e.method}): ${how}; ${n ? plural(n, "divergence") + " from the recording" : "no divergences"}`),
    divergences(e.differences),
    e.note ? para(e.note, "text muted") : null,
    e.skipped?.length ? para(`left out: ${e.skipped.map((s) => `${s.path} (${s.reason})`).join(", ")}`, "text muted") : null,
  ];
}

// The body of an event's card: every kind read as what it means.
function render(e) {
  switch (e.kind) {
    case "cmd_run": return [block(`$ ${e.command}`)];
    case "cmd_output": return [block(e.content), e.timed_out ? para("timed out", "text bad") : null, e.truncated ? para("output truncated", "text muted") : null];
    case "python_run": return [block(e.code)];
    case "python_output":
      return [
        e.content ? block(e.content, "output") : null,
        e.result != null ? block(e.result, "value", "value") : null,
        e.exception ? block(e.exception, "exception", "exception") : null,
        e.files?.length ? para(`files: ${e.files.join(", ")}`) : null,
        !e.content && e.result == null && !e.exception ? para("(no output)", "text muted") : null,
        e.timed_out ? para("timed out", "text bad") : null,
        e.state_lost ? para("the Python process was restarted: its variables are gone", "text bad") : null,
        e.truncated ? para("output truncated", "text muted") : null,
      ];
    case "file_content": return [para(e.path), block(e.content)];
    case "file_edited": return [para(e.path), block(e.diff ?? "")];
    case "file_write": return [para(e.path), block(e.content ?? "")];
    case "recall_result":
      return [(e.hits ?? []).length ? el("ol", { class: "view hits" }, ...e.hits.map((h) => el("li", {}, el("span", { class: "id", text: `#${h.event_id}` }), el("span", { class: "kind", text: h.kind }), el("span", { class: "text", text: clip(h.text, 300) })))) : para(`${e.recall_type}: no hits`)];
    case "llm_response": return [e.content ? para(e.content) : null, ...toolCalls(e.tool_calls), usage(e)];
    case "session_config": {
      const lines = configLines(e);
      return [lines.length ? el("ul", { class: "config" }, ...lines.map((l) => el("li", { text: l }))) : para("no change", "text muted")];
    }
    case "sandbox_rebuilt": return rebuilt(e);
    case "forked": return [el("p", { class: "text" }, "forked from ", link(e.source_session), ` at event #${e.at}; sandbox: ${e.workspace ?? "empty"}`)];
    case "delegated": return [el("p", { class: "text" }, "sub-agent of ", link(e.parent), ` for its action #${e.parent_action}`), e.task ? para(e.task) : null];
    case "delegate_result":
      return [
        el("p", { class: "text" }, "sub-agent ", link(e.session), e.content ? `: ${clip(e.content, 2000)}` : ""),
        e.state ? el("div", { class: "usage" }, statusBadge(e.state), e.tokens != null ? el("span", { text: `${e.tokens} tokens` }) : null, el("span", { text: money(e.cost) })) : null,
      ];
    default: {
      const text = summary(e);
      return [text ? para(clip(text, 4000)) : null];
    }
  }
}

const ACTIONS = new Set(["message", "cmd_run", "file_read", "file_write", "file_edit", "python_run", "recall", "condensation_request", "think", "finish", "delegate"]);

function category(e) {
  if (e.kind === "error") return "error";
  if (e.kind === "condensation" || e.kind === "summary" || e.kind === "context_edit" || e.kind === "condensation_request") return "condensation";
  if (e.kind === "llm_response") return "llm";
  if (ACTIONS.has(e.kind)) return "action";
  if (e.cause != null) return "observation";
  return "system";
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

// Where a session stands, read from its events as the server's session list reads it.
function sessionStatus(events) {
  const ends = { step_limit: "step limit", budget_exhausted: "budget exhausted", cancelled: "cancelled", llm_error: "error" };
  for (let i = events.length - 1; i >= 0; i--) {
    const e = events[i];
    if (e.kind === "finish") return "finished";
    if (e.kind === "error" && e.source === "agent" && e.reason in ends) return ends[e.reason];
    if (e.kind === "run_paused" && e.source === "user") return "paused";
    if (e.kind === "run_resumed" && e.source === "user") return "running";
    if (e.kind === "run_started") return "running";
    if (e.kind === "message" && e.source === "user") return "open";
  }
  return "open";
}

// --- the session page ------------------------------------------------------------------------

class SessionView {
  constructor(session, signal) {
    this.session = session;
    this.signal = signal;
    this.events = new Map(); // id -> event
    this.answers = new Map(); // action id -> observation
    this.hiddenBy = new Map(); // event id -> what hid it, as of the selected event
    this.nodes = new Map(); // id -> li of the event (or of its action)
    this.last = 0;
    this.selected = null;
    this.pinned = false; // the slider follows the newest event until the user moves it
    this.timer = null;
    this.pins = new Set(); // pinned event ids, as of the selected event
    this.range = null; // [first, last] chosen for a context edit
    this.preview = null; // the body of the edit last previewed
    this.refreshTimer = null;
    this.used = null; // the last GET usage: the run panel's steps, tokens and cost
    this.children = new Map(); // sub-agent session -> delegate_result
    this.parent = null; // the delegated event, when this session is a sub-agent
    this.decisions = new Map(); // action id -> the approval that decided it (the first holds)
    this.waiting = new Set(); // ids of the calls shown with Approve and Reject
  }

  get current() {
    return state.view === this && !this.signal.aborted;
  }

  // The token usage per step, and the run's numbers: from the server, after any batch.
  refreshSoon() {
    clearTimeout(this.refreshTimer);
    this.refreshTimer = setTimeout(() => this.refresh(), 150);
  }

  async refresh() {
    try {
      const used = await (await api(`${sessionPath(this.session)}/usage`, { signal: this.signal })).json();
      if (!this.current) return;
      this.used = used;
      const rows = used.steps.map((s) => el("tr", {}, el("td", { class: "num", text: `#${s.event_id}` }), el("td", { text: s.model }), el("td", { class: "num", text: String(s.prompt_tokens) }), el("td", { class: "num", text: String(s.cached_tokens) }), el("td", { class: "num", text: String(s.completion_tokens) }), moneyCell(s.cost, 6)));
      if (used.steps.length) rows.push(el("tr", { class: "total" }, el("td", { text: "total" }), el("td", { text: plural(used.steps.length, "call") }), el("td", { class: "num", text: String(used.prompt_tokens) }), el("td", { class: "num", text: String(used.cached_tokens) }), el("td", { class: "num", text: String(used.completion_tokens) }), moneyCell(used.cost, 6)));
      else rows.push(el("tr", {}, el("td", { colspan: "6", class: "muted", text: "no model calls in this session" })));
      $("usage-rows").replaceChildren(...rows);
      this.renderRun(used);
    } catch (error) {
      if (this.current) $("ctx-result").textContent = error.message;
    }
  }

  // The latest run: state, steps, tokens, cost, and a cancel button while it runs.
  renderRun(used) {
    const all = [...this.events.values()];
    const opened = all.filter((e) => e.kind === "run_started").pop();
    if (!opened) {
      $("run-panel").hidden = true;
      return;
    }
    const after = all.filter((e) => e.id > opened.id);
    const status = sessionStatus([opened, ...after]);
    // Its own model calls, and with its sub-agents' (their delegate_result): what the runs list shows.
    const steps = (used?.steps ?? []).filter((s) => s.event_id > opened.id);
    const results = after.filter((e) => e.kind === "delegate_result");
    const tokens = steps.reduce((n, s) => n + s.prompt_tokens + s.completion_tokens, 0);
    const sum = (costs) => (costs.some((c) => c == null) ? null : costs.reduce((n, c) => n + c, 0));
    const cost = sum(steps.map((s) => s.cost));
    let spent = `${count(tokens)} tokens, ${money(cost)}`;
    if (results.length) {
      const treeTokens = tokens + results.reduce((n, e) => n + (e.tokens ?? 0), 0);
      const treeCost = cost == null ? null : sum([cost, ...results.map((e) => e.cost)]);
      spent = `its own calls ${spent}; with its ${plural(results.length, "sub-agent")} ${count(treeTokens)} tokens, ${money(treeCost)}`;
    }
    $("run-panel").hidden = false;
    $("run-state").replaceChildren(statusBadge(status));
    $("run-numbers").textContent = `run #${opened.id}: ${plural(steps.length, "step")} of ${opened.max_steps ?? 30}, ${spent}`;
    $("run-numbers").title = cost == null ? UNPRICED : "";
    const open = status === "running" || status === "paused";
    const asked = after.some((e) => e.kind === "run_cancel");
    $("run-cancel").hidden = !open || asked;
    $("run-pause").hidden = status !== "running" || asked;
    $("run-resume").hidden = status !== "paused" || asked;
    const waiting = after.filter((e) => this.pending(e) === "waiting").length;
    $("run-waiting").textContent = waiting ? `${plural(waiting, "call")} ${waiting === 1 ? "waits" : "wait"} for your approval` : "";
  }

  // What hides each event and what is pinned as of the selected event (condensations and user
  // edits alike), from the server: the badges follow time travel.
  async loadContext(until) {
    const context = await (await api(`${sessionPath(this.session)}/context?until=${until}`, { signal: this.signal })).json();
    if (!this.current || until !== this.selected) return;
    const before = this.hiddenBy;
    const pinsBefore = this.pins;
    this.hiddenBy = new Map(context.hidden.map((h) => [h.id, h.by]));
    this.pins = new Set(context.pinned);
    const changed = new Set([...before.keys(), ...this.hiddenBy.keys(), ...pinsBefore, ...this.pins]);
    for (const id of changed) if (before.get(id) !== this.hiddenBy.get(id) || pinsBefore.has(id) !== this.pins.has(id)) this.rerender(id);
    for (const e of this.events.values()) if (e.kind === "condensation") this.rerender(e.id);
  }

  choose(id, extend) {
    const [first] = extend && this.range ? this.range : [id];
    this.range = [Math.min(first, id), Math.max(first, id)];
    $("ctx-from").value = String(this.range[0]);
    $("ctx-to").value = String(this.range[1]);
    this.clearPreview();
    for (const li of $("timeline").children) {
      const n = Number(li.dataset.id);
      li.classList.toggle("chosen", n >= this.range[0] && n <= this.range[1]);
    }
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
    ].filter(([, ids]) => ids.length).map(([what, ids]) => `${what} ${plural(ids.length, "event")} (${list(ids)})`);
    return parts.join("; ") || (verb === "would" ? "would change nothing" : "changed nothing");
  }

  async previewEdit() {
    this.clearPreview();
    const body = this.editBody(true);
    $("ctx-result").textContent = "previewing…";
    try {
      const change = await (await api(`${sessionPath(this.session)}/context`, { method: "POST", body, signal: this.signal })).json();
      if (!this.current) return; // the page shows another session now
      $("ctx-result").textContent = `${body.op} as edit #${change.edit}: ${this.describe(change, "would")}`;
      for (const [ids, cls] of [[change.hidden, "would-hide"], [change.shown, "would-show"]]) for (const id of ids) this.nodes.get(id)?.classList.add(cls);
      this.preview = { ...body, dry_run: false };
      $("ctx-apply").disabled = false;
    } catch (error) {
      if (this.current) $("ctx-result").textContent = error.message;
    }
  }

  async applyEdit() {
    if (!this.preview) return;
    const body = this.preview;
    this.clearPreview();
    this.pinned = false; // travel with the log to the edit, to show what it did
    try {
      // What hid each event before a restore: a condenser hides its own again at its next condensation.
      const before = body.op === "restore" ? await (await api(`${sessionPath(this.session)}/context`, { signal: this.signal })).json() : null;
      const change = await (await api(`${sessionPath(this.session)}/context`, { method: "POST", body, signal: this.signal })).json();
      if (!this.current) return;
      let said = `applied edit #${change.edit} (${body.op}): ${this.describe(change, "did")}`;
      if (before) {
        const hidBy = new Map(before.hidden.map((h) => [h.id, h.by]));
        const pinned = new Set(before.pinned);
        const again = change.shown.filter((id) => !pinned.has(id) && this.events.get(hidBy.get(id))?.kind === "condensation" && this.events.get(hidBy.get(id))?.source === "condenser");
        const spans = ranges(again.reduce((runs, id) => { const last = runs[runs.length - 1]; if (last && id === last[1] + 1) last[1] = id; else runs.push([id, id]); return runs; }, []));
        if (again.length) said += `. A condenser had hidden ${spans}: it hides them again at its next condensation (within seconds when the view is over its limits); pin them to keep them in view.`;
      }
      $("ctx-result").textContent = said;
    } catch (error) {
      if (this.current) $("ctx-result").textContent = error.message;
    }
  }

  add(batch) {
    if (!this.current) return;
    for (const e of batch) {
      this.events.set(e.id, e);
      this.last = Math.max(this.last, e.id);
      if (e.kind === "delegated" && !this.parent) this.parent = e;
      if (e.kind === "delegate_result" && e.session) this.children.set(e.session, e);
      if (e.kind === "approval" && e.source === "user") for (const a of e.actions ?? []) if (!this.decisions.has(a)) this.decisions.set(a, e);
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
    }
    // A call shown waiting that was decided, answered or whose run ended meanwhile.
    for (const id of [...this.waiting]) {
      const e = this.events.get(id);
      if (e && this.pending(e) !== "waiting") {
        this.waiting.delete(id);
        this.rerender(id);
      }
    }
    this.renderTree();
    // A run's panel (above the timeline) shows up with the batch that opened it, not when its
    // usage arrives: the cards below would move under a pointer about to click Approve or Reject.
    if ($("run-panel").hidden && batch.some((e) => e.kind === "run_started")) this.renderRun(this.used);
    this.refreshSoon();
    $("session-meta").replaceChildren(`${this.tenantText} · ${plural(this.last, "event")} · `, statusBadge(sessionStatus([...this.events.values()])));
    const slider = $("slider");
    slider.max = String(Math.max(1, this.last));
    if (!this.pinned) this.select(this.last, false);
    else this.shade();
  }

  // The delegation tree: the parent of a sub-agent, and the sub-agents of this session.
  renderTree() {
    const parts = [];
    if (this.parent) parts.push(el("span", { class: "parent" }, "sub-agent of ", link(this.parent.parent), ` (action #${this.parent.parent_action})`));
    if (this.children.size) parts.push(el("span", { class: "children" }, "sub-agents: ", ...[...this.children.keys()].flatMap((s, i) => [i ? ", " : null, link(s)])));
    $("delegation").replaceChildren(...parts.flatMap((p, i) => (i ? [" · ", p] : [p]))); // (a null would read "null")
    $("delegation").hidden = !parts.length;
  }

  rerender(id) {
    const old = this.nodes.get(id);
    const e = this.events.get(id);
    if (!old || !e || old.dataset.id !== String(id)) return;
    const fresh = this.card(e);
    for (const cls of ["would-hide", "would-show", "chosen"]) if (old.classList.contains(cls)) fresh.classList.add(cls);
    old.replaceWith(fresh);
    for (const [key, node] of this.nodes) if (node === old) this.nodes.set(key, fresh);
    this.shade();
  }

  // A condensation's own account: what it hid when it was made, and what was shown again
  // by the selected event (a restore), so it never reads "hid 0".
  condensed(e) {
    let count = 0;
    for (const [a, b] of e.forgotten ?? []) count += Math.max(0, Math.min(b, e.id - 1) - a + 1);
    const lines = [`hid ${plural(count, "event")} (${ranges(e.forgotten) || "none"}) from the context${e.summary ? "; summary:" : ""}`];
    if (this.selected != null && this.selected >= e.id) {
      let shown = 0;
      for (const [a, b] of e.forgotten ?? []) for (let id = a; id <= Math.min(b, e.id - 1); id++) if (this.events.has(id) && !this.hiddenBy.has(id)) shown++;
      const by = [...this.events.values()].filter((x) => x.kind === "context_edit" && x.op === "restore" && x.id > e.id && x.id <= this.selected).map((x) => `#${x.id}`);
      if (shown) lines.push(`${plural(shown, "event")} of them shown again${by.length ? ` by ${by.join(", ")}` : ""} as of #${this.selected}`);
    }
    return lines.map((t) => para(t));
  }

  card(e) {
    const hidden = this.hiddenBy.get(e.id);
    const classes = ["ev", category(e)];
    if (hidden && e.id <= (this.selected ?? this.last)) classes.push("hidden-by");
    if (this.pins.has(e.id)) classes.push("pinned");
    const head = el(
      "div",
      { class: "head" },
      el("span", { class: "id", text: `#${e.id}` }),
      el("span", { class: "kind", text: e.kind === "unknown" ? `?${e.original_kind}` : e.kind }),
      el("span", { class: "src", text: e.source }),
      classes.includes("hidden-by") ? el("span", { class: "badge cond", text: `hidden by #${hidden}` }) : null,
      timeEl(e.ts, "ts"),
      el("button", { class: "link travel-here", type: "button", text: "travel here", title: `the context as the agent saw it after event ${e.id}`, onclick: (ev) => { ev.stopPropagation(); this.select(e.id, true); } }),
      el("button", { class: "link fork-here", type: "button", text: "fork here", title: `fork this session at event ${e.id}`, onclick: (ev) => { ev.stopPropagation(); this.select(e.id, true); $("fork-into").focus(); } }),
    );
    const li = el("li", { class: classes.join(" "), "data-id": String(e.id), title: "click to choose it (or its answer) for a context edit; shift-click: a range", onclick: (ev) => { if (ev.target.closest("a, button, details, pre")) return; this.choose(Number(ev.target.closest("[data-id]").dataset.id), ev.shiftKey); } }, head);
    if (e.kind === "condensation") li.append(...this.condensed(e));
    for (const node of render(e)) if (node) li.append(node);
    if (e.risk) li.append(this.risk(e));
    li.append(raw(e));
    const answer = this.answers.get(e.id);
    if (answer) {
      const exit = answer.exit_code != null ? el("span", { class: "badge" + (answer.exit_code ? " bad" : ""), text: `exit ${answer.exit_code}` }) : null;
      const answerNode = el(
        "div",
        { class: "answer" + (answer.kind === "error" ? " error" : ""), "data-id": String(answer.id) },
        el("div", { class: "head" }, el("span", { class: "id", text: `#${answer.id}` }), el("span", { class: "kind", text: answer.kind }), exit, timeEl(answer.ts, "ts")),
      );
      for (const node of render(answer)) if (node) answerNode.append(node);
      answerNode.append(raw(answer));
      li.append(answerNode);
    }
    return li;
  }

  // Where a call that waits for approval stands: "waiting" (no decision, no answer, its run
  // open), "approved", "rejected", "answered", or "ended" (its run ended undecided).
  pending(e) {
    if (!e.risk?.confirm) return null;
    if (this.answers.has(e.id)) return "answered";
    const decided = this.decisions.get(e.id);
    if (decided) return decided.decision === "approve" ? "approved" : "rejected";
    for (const x of this.events.values()) {
      if (x.id <= e.id) continue;
      if (x.kind === "finish" || (x.kind === "error" && x.source === "agent" && RUN_ENDS.has(x.reason))) return "ended";
    }
    return "waiting";
  }

  // A call's risk as the agent labelled it, and, when it waits for a person, Approve and Reject.
  risk(e) {
    const where = this.pending(e);
    const node = el(
      "div",
      { class: "risk-line" + (where === "waiting" ? " waiting" : ""), "data-pending": where },
      riskBadge(e.risk.level),
      e.risk.reason ? el("span", { class: "risk-reason", text: clip(e.risk.reason, 2000) }) : null,
    );
    const decided = this.decisions.get(e.id);
    if (where === "waiting") {
      node.append(el("span", { class: "waits", text: "waits for your approval" }), decisionControls(this.session, e.id));
      this.waiting.add(e.id);
    } else if (decided) {
      const verb = decided.decision === "approve" ? "approved" : "rejected";
      node.append(el("span", { class: "decided", text: `${verb} (#${decided.id}${decided.by ? `, by ${decided.by}` : ""})${decided.reason ? `: ${clip(decided.reason, 2000)}` : ""}` }));
    } else if (where === "ended") {
      node.append(el("span", { class: "muted", text: "the run ended before anyone decided" }));
    }
    return node;
  }

  select(id, byUser) {
    if (byUser) this.pinned = id !== this.last;
    this.selected = id;
    $("slider").value = String(id);
    $("at").textContent = String(id);
    $("fork-at").textContent = String(id);
    if (byUser || !$("fork-into").value) $("fork-into").value = `${this.session}-fork-${id}`.slice(0, 128);
    this.shade(byUser);
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
  // says why it matched (by meaning, by words) and travels to its event.
  async search(query) {
    $("search-note").textContent = "searching…";
    $("search-clear").hidden = false;
    const path = `${sessionPath(this.session)}/recall?k=8&q=${encodeURIComponent(query)}`;
    try {
      const { hits } = await (await api(path, { signal: this.signal })).json();
      if (!this.current) return;
      $("search-note").textContent = hits.length
        ? `${plural(hits.length, "hit")}, best first; click one to travel to it`
        : "no hits (an event is searchable once a memory worker has indexed it)";
      $("search-hits").replaceChildren(
        ...hits.map((h) =>
          el(
            "li",
            { "data-id": String(h.event_id), title: clip(h.text, 2000), onclick: () => this.select(h.event_id, true) },
            el("span", { class: "id", text: `#${h.event_id}` }),
            el("span", { class: "kind", text: h.kind }),
            el("span", { class: "why", title: `fused score ${h.score}` }, ...why(h)),
            el("span", { class: "text", text: clip(h.text, 300) }),
          ),
        ),
      );
    } catch (error) {
      $("search-hits").replaceChildren();
      if (this.current) $("search-note").textContent = error.message;
    }
  }

  async loadView() {
    const until = this.selected;
    const mode = document.querySelector('input[name="mode"]:checked').value;
    let items;
    let note;
    try {
      const context = this.loadContext(until);
      context.catch(() => {}); // (awaited below; an abort must not go unhandled meanwhile)
      if (mode === "full") {
        const text = await (await api(`${sessionPath(this.session)}/events?until=${until}`, { signal: this.signal })).text();
        items = text.split("\n").filter(Boolean).map((line) => JSON.parse(line));
        note = `the full log: ${plural(items.length, "event")} up to #${until}`;
      } else {
        const view = await (await api(`${sessionPath(this.session)}/view?until=${until}`, { signal: this.signal })).json();
        items = view.events;
        const shown = items.filter((e) => e.id != null).length;
        note = `${shown} of ${until} events in the context` + (view.summary_index != null ? `, a summary at position ${view.summary_index + 1}` : "");
      }
      await context;
    } catch (error) {
      if (this.current) $("view-note").textContent = error.message;
      return;
    }
    if (until !== this.selected || !this.current) return; // the slider moved on meanwhile
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

  // After a fork: the new session's link, then how its sandbox was rebuilt (followed on its
  // log until the runtime's sandbox_rebuilt comes), with every divergence from the recording.
  async forked(result) {
    const into = result.session;
    const status = el("span", { class: "muted", text: "" });
    const details = el("div", { class: "rebuild" });
    $("fork-result").replaceChildren("forked: ", el("a", { href: sessionHref(into), text: into }), " · ", status, details);
    status.textContent = result.workspace === "empty"
      ? "its sandbox starts empty"
      : `its sandbox is built (${result.workspace}) when a runtime worker takes the session…`;
    const done = new AbortController();
    const stopWith = () => done.abort();
    this.signal.addEventListener("abort", stopWith, { once: true });
    await follow(into, result.forked ?? 0, (batch) => {
      const rebuiltEvent = batch.find((e) => e.kind === "sandbox_rebuilt");
      if (!rebuiltEvent || !this.current) return;
      const n = (rebuiltEvent.differences ?? []).length;
      status.textContent = n ? `rebuilt with ${plural(n, "divergence")}` : "rebuilt: no divergences";
      details.replaceChildren(...rebuilt(rebuiltEvent).filter(Boolean));
      done.abort();
    }, done.signal);
    this.signal.removeEventListener("abort", stopWith);
  }
}

function why(h) {
  const parts = [];
  const meaning = h.why?.meaning;
  const words = h.why?.words;
  if (meaning) parts.push(el("span", { class: "by-meaning", text: `meaning #${meaning.rank} (${Number(meaning.similarity).toFixed(2)})` }));
  if (words) parts.push(el("span", { class: "by-words", text: words.matched?.length ? `words: ${words.matched.join(", ")}` : `words #${words.rank}` }));
  if (!parts.length) parts.push(el("span", { text: `score ${Number(h.score).toFixed(3)}` }));
  return parts;
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
  $("ctx-result").textContent = "Click an event (shift-click another for a range), or choose a kind, then preview.";
  $("usage-rows").replaceChildren();
  $("run-panel").hidden = true;
  $("run-note").textContent = "";
  $("delegation").replaceChildren();
  $("delegation").hidden = true;
  clearSearch();
  $("crumbs").replaceChildren(el("a", { href: "#/", text: "sessions" }), ` / ${session}`);
  const view = new SessionView(session, signal);
  state.view = view;
  try {
    const { sessions } = await (await api(`/v1/sessions?limit=200&q=${encodeURIComponent(session)}`, { signal })).json();
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
$("slider").addEventListener("input", () => state.view?.select(Number($("slider").value), true));
for (const id of ["ctx-op", "ctx-from", "ctx-to", "ctx-kind", "ctx-note"]) $(id).addEventListener("input", () => state.view?.clearPreview());
$("ctx-preview").addEventListener("click", () => state.view?.previewEdit());
$("ctx-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.view?.applyEdit();
});
for (const kind of ["error", "cmd_run", "cmd_output", "think", "message", "recall", "recall_result", "python_run", "python_output", "file_read", "file_content", "file_write", "file_written", "file_edit", "file_edited", "llm_response"]) $("ctx-kind").append(el("option", { value: kind, text: kind }));
for (const status of STATUSES) $("list-status").append(el("option", { value: status, text: status }));
for (const runState of RUN_STATES) $("runs-state").append(el("option", { value: runState, text: runState }));
for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", () => state.view?.loadView());
$("fork-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const view = state.view;
  if (!view) return;
  const into = $("fork-into").value.trim();
  const workspace = $("fork-workspace").value;
  $("fork-result").textContent = "forking…";
  try {
    const result = await (await api(`${sessionPath(view.session)}/fork`, { method: "POST", body: { at: view.selected, into, workspace }, signal: view.signal })).json();
    if (view.current) await view.forked({ ...result, workspace });
  } catch (error) {
    if (view.current) $("fork-result").textContent = error.message;
  }
});
$("run-cancel").addEventListener("click", (event) => {
  if (state.view) cancelRun(state.view.session, event.currentTarget, $("run-note"));
});
for (const [id, verb] of [["run-pause", "pause"], ["run-resume", "resume"]]) {
  $(id).addEventListener("click", async (event) => {
    const view = state.view;
    if (!view) return;
    const button = event.currentTarget;
    button.disabled = true;
    try {
      await api(`${sessionPath(view.session)}/runs/${verb}`, { method: "POST" });
      if (view.current) $("run-note").textContent = verb === "pause" ? "paused: no model call and no new action until resumed" : "resumed";
    } catch (error) {
      if (view.current) $("run-note").textContent = error.message;
    } finally {
      button.disabled = false;
    }
  });
}
$("list-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const params = new URLSearchParams();
  for (const [name, id] of [["q", "list-q"], ["tenant", "list-tenant"], ["status", "list-status"]]) if ($(id).value.trim()) params.set(name, $(id).value.trim());
  const limit = hashParams().get("limit");
  if (limit) params.set("limit", limit);
  location.hash = `#/?${params}`;
});
$("runs-state").addEventListener("change", () => {
  location.hash = $("runs-state").value ? `#/runs?state=${encodeURIComponent($("runs-state").value)}` : "#/runs";
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
