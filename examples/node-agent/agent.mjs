#!/usr/bin/env node
// A riverbed agent in JavaScript that holds nothing but an API key: it drives a session through
// the HTTP API (`riverbed serve`), runs a shell command through /act, and follows the session's
// log live over Server-Sent Events, resuming with Last-Event-ID after a reconnect.
//
// Node 20 or newer, no npm packages: the global fetch, and SSE parsed by hand.
//
//   RIVERBED_URL=http://127.0.0.1:8300 RIVERBED_KEY=rbk_... node agent.mjs my-session 'uname -s'
//
// It prints one JSON object a line: each event as the log delivers it ({"followed": …}), the
// observation of the command ({"observation": …}) and a summary at the end ({"done": …}).

const base = (process.env.RIVERBED_URL ?? "http://127.0.0.1:8300").replace(/\/$/, "");
const key = process.env.RIVERBED_KEY;
const session = process.argv[2] ?? `node-${Date.now()}`;
const command = process.argv[3] ?? "echo hello from node";

if (!key) {
  console.error("agent.mjs: set RIVERBED_KEY to an API key (riverbed keys create --tenant T)");
  process.exit(2);
}

const headers = { Authorization: `Bearer ${key}`, "Content-Type": "application/json" };
const print = (object) => process.stdout.write(JSON.stringify(object) + "\n");

// One request; an error answer is a problem document whose `detail` says what went wrong.
async function call(method, path, body, signal) {
  const response = await fetch(`${base}${path}`, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!response.ok) {
    const problem = await response.json().catch(() => ({}));
    const error = new Error(`${method} ${path}: ${response.status} ${problem.detail ?? response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return response;
}

// Follow the log from `from` (or after `lastEventId`) and hand each event to `onEvent`; resolves
// when `onEvent` returns true or `signal` aborts. Returns the id of the last event seen.
async function follow({ from = 1, lastEventId, onEvent, signal }) {
  const streamHeaders = { ...headers, Accept: "text/event-stream" };
  if (lastEventId !== undefined) streamHeaders["Last-Event-ID"] = String(lastEventId);
  const response = await fetch(`${base}/v1/sessions/${encodeURIComponent(session)}/events?from=${from}`, {
    headers: streamHeaders,
    signal,
  });
  if (!response.ok) throw new Error(`follow: ${response.status} ${(await response.json()).detail}`);
  const decoder = new TextDecoder();
  let buffer = "";
  let last = lastEventId;
  let message = { id: undefined, data: [] };
  for await (const chunk of response.body) {
    buffer += decoder.decode(chunk, { stream: true });
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, "");
      buffer = buffer.slice(newline + 1);
      if (line === "") {
        // A blank line ends a message.
        if (message.data.length > 0) {
          const event = JSON.parse(message.data.join("\n"));
          last = Number(message.id ?? event.id);
          if (onEvent(event)) return last; // leaving the loop cancels the stream
        }
        message = { id: undefined, data: [] };
      } else if (line.startsWith(":")) {
        // A comment: the server's keep-alive.
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "id") message.id = value;
        else if (field === "data") message.data.push(value);
      }
    }
  }
  return last;
}

async function main() {
  const path = `/v1/sessions/${encodeURIComponent(session)}`;
  // The first append creates the session, owned by the key's tenant.
  const created = await (
    await call("POST", `${path}/events`, { kind: "message", source: "user", content: `please run: ${command}` })
  ).json();
  print({ appended: created.ids });

  // Follow the log while the command runs; stop once its observation has arrived.
  const followed = [];
  let actionId;
  let answered = false;
  const until = new AbortController();
  const following = follow({
    from: 1,
    signal: until.signal,
    onEvent: (event) => {
      followed.push(event.id);
      print({ followed: { id: event.id, kind: event.kind, cause: event.cause } });
      answered ||= actionId !== undefined && event.cause === actionId;
      return answered;
    },
  });

  const observation = await (await call("POST", `${path}/act?timeout=30`, { kind: "cmd_run", command })).json();
  actionId = observation.cause;
  answered ||= followed.includes(observation.id);
  print({ observation });
  if (!answered) {
    // The observation may already have been streamed before we learnt the action's id.
    const timer = setTimeout(() => until.abort(), 10_000);
    await following.catch((error) => {
      if (error.name !== "AbortError") throw error;
    });
    clearTimeout(timer);
  } else {
    until.abort();
    await following.catch(() => {});
  }

  // Reconnect after the last event seen: only what came since is delivered, nothing twice.
  const last = Math.max(...followed);
  await call("POST", `${path}/events`, { kind: "finish", final_thought: "done" });
  const resumed = [];
  await follow({
    lastEventId: last,
    onEvent: (event) => {
      resumed.push(event.id);
      return event.kind === "finish";
    },
  });
  print({ done: { session, followed, resumed, exit_code: observation.exit_code } });
}

main().catch((error) => {
  console.error(`agent.mjs: ${error.message}`);
  process.exit(1);
});
