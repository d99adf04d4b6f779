// The agentry dashboard: plain DOM, no framework, no build step. Everything the server
// sends is put on the page as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "agentry.token";
let token = localStorage.getItem(TOKEN_KEY) || "";
let pageAbort = null; // aborts the streams of the page being left

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.code = problem && problem.code;
  }
}

function headers(extra) {
  const h = Object.assign({ Accept: "application/json" }, extra || {});
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

async function api(method, path, body) {
  const init = { method, headers: headers(), credentials: "same-origin" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401) {
    signedOut();
    throw new ApiError(401, { detail: "signed out" });
  }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new ApiError(res.status, data);
  return data;
}

// Follow an SSE stream with fetch (EventSource cannot send a bearer token), resuming
// with Last-Event-ID after a drop; `onEvent(id, data)` sees each id once, in order.
async function follow(path, after, onEvent, onState, signal) {
  let last = after;
  let delay = 500;
  while (!signal.aborted) {
    try {
      const h = headers({ Accept: "text/event-stream" });
      h["Last-Event-ID"] = String(last);
      const res = await fetch(path, { headers: h, credentials: "same-origin", signal });
      if (res.status === 401) { signedOut(); return; }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      onState(true);
      delay = 500;
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, end);
          buf = buf.slice(end + 2);
          let id = null, data = null;
          for (const line of frame.split("\n")) {
            if (line.startsWith("id: ")) id = Number(line.slice(4));
            else if (line.startsWith("data: ")) data = line.slice(6);
          }
          if (id === null || data === null || id <= last) continue;
          last = id;
          onEvent(id, JSON.parse(data));
        }
      }
    } catch (e) {
      if (signal.aborted) return;
    }
    onState(false);
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 8000);
  }
}

function statusBadge(status) {
  return el("span", { class: `badge ${status}` }, status);
}

function labelChips(labels) {
  return Object.entries(labels || {}).map(([k, v]) => el("span", { class: "label" }, `${k}=${v}`));
}

function navigate(path) {
  history.pushState(null, "", path);
  route();
}

function link(path, text) {
  return el("a", { href: path, onclick: (e) => { if (!e.metaKey && !e.ctrlKey) { e.preventDefault(); navigate(path); } } }, text);
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.filter((n) => n !== null && n !== undefined && n !== false));
}

function failure(e) {
  return el("p", { class: "error-text", role: "alert" }, e.message || String(e));
}

// ---------------------------------------------------------------------------------------
// Sign-in
// ---------------------------------------------------------------------------------------

function signedOut() {
  token = "";
  localStorage.removeItem(TOKEN_KEY);
  signInPage();
}

async function signInPage() {
  if (pageAbort) pageAbort.abort();
  document.getElementById("who").replaceChildren();
  let config = { oidc: false };
  try { config = await (await fetch("/ui/config")).json(); } catch (_) { /* local */ }
  const input = el("input", { id: "token", type: "password", autocomplete: "off", spellcheck: "false" });
  const message = el("p", { class: "error-text", role: "alert" });
  const form = el("form", {
    onsubmit: async (e) => {
      e.preventDefault();
      const candidate = input.value.trim();
      try {
        const res = await fetch("/v1/me", { headers: { Authorization: `Bearer ${candidate}`, Accept: "application/json" } });
        if (res.status === 401) { message.textContent = "This token is not valid."; return; }
        if (!res.ok) { message.textContent = `The server answered ${res.status}.`; return; }
        token = candidate;
        localStorage.setItem(TOKEN_KEY, token);
        route();
      } catch (err) {
        message.textContent = `Cannot reach the server: ${err.message}`;
      }
    },
  },
    el("label", { for: "token" }, "API token"),
    input,
    el("button", { class: "primary", type: "submit" }, "Sign in with token"),
  );
  show(el("section", { class: "signin card" },
    el("h1", {}, "Sign in to agentry"),
    config.oidc
      ? el("p", {}, el("button", { class: "primary", type: "button", onclick: () => {
          location.href = `/auth/login?return_to=${encodeURIComponent(location.pathname)}`;
        } }, "Sign in"))
      : null,
    form,
    message,
  ));
  input.focus();
}

async function whoAmI() {
  const me = await api("GET", "/v1/me");
  const out = el("button", { type: "button", onclick: async () => {
    if (!token) { try { await api("POST", "/auth/logout"); } catch (_) { /* gone */ } }
    signedOut();
  } }, "Sign out");
  document.getElementById("who").replaceChildren(el("span", {}, me.email || me.name || me.id), out);
  return me;
}

// ---------------------------------------------------------------------------------------
// Home: projects, workspaces and agents with live status
// ---------------------------------------------------------------------------------------

async function homePage(signal) {
  const [projects, agents] = await Promise.all([
    api("GET", "/v1/projects?limit=200"),
    api("GET", "/v1/agents?limit=200"),
  ]);
  const filter = el("input", { id: "filter", type: "search", placeholder: "status, provider or label" });
  const rows = new Map();
  const tbody = el("tbody");
  const row = (a) => {
    const attention = a.status === "waiting_permission" || a.pending_permissions > 0
      ? el("span", { class: "badge waiting_permission" }, "needs you")
      : a.status === "error" ? el("span", { class: "badge error" }, "failed") : null;
    const tr = el("tr", { "data-agent": a.id },
      el("td", {}, link(`/agents/${a.id}`, a.title || a.id), " ", ...labelChips(a.labels)),
      el("td", {}, statusBadge(a.status), " ", attention),
      el("td", {}, a.provider),
      el("td", { class: "muted" }, new Date(a.created_at).toLocaleString()),
    );
    tr.dataset.search = `${a.status} ${a.provider} ${a.title || ""} ${Object.entries(a.labels || {}).map(([k, v]) => `${k}=${v}`).join(" ")}`.toLowerCase();
    return tr;
  };
  for (const a of agents.items) { const r = row(a); rows.set(a.id, r); tbody.append(r); }
  const applyFilter = () => {
    const q = filter.value.trim().toLowerCase();
    for (const r of rows.values()) r.hidden = q !== "" && !r.dataset.search.includes(q);
  };
  filter.addEventListener("input", applyFilter);

  const projectList = el("ul", {}, projects.items.map((p) => el("li", {}, el("strong", {}, p.name), " ", el("span", { class: "muted" }, p.repo_path))));
  show(
    el("h1", {}, "Agents"),
    el("div", { class: "row" }, el("label", { for: "filter" }, "Filter"), filter),
    el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "Agent"), el("th", {}, "Status"), el("th", {}, "Provider"), el("th", {}, "Created"))), tbody),
    agents.items.length ? null : el("p", { class: "muted" }, "No agents yet. Start one with the API or `agentry run`."),
    el("h2", {}, "Projects"),
    projects.items.length ? projectList : el("p", { class: "muted" }, "No projects yet."),
  );
  // Live: the team stream, from now on.
  follow("/v1/events", 0, async (_id, ev) => {
    const d = ev.data || {};
    if (ev.kind === "agent_status" && rows.has(d.agent_id)) {
      const a = await api("GET", `/v1/agents/${d.agent_id}`);
      const r = row(a); rows.get(d.agent_id).replaceWith(r); rows.set(a.id, r); applyFilter();
    } else if (ev.kind === "agent_created" && !rows.has(d.agent_id)) {
      const a = await api("GET", `/v1/agents/${d.agent_id}`);
      const r = row(a); rows.set(a.id, r); tbody.prepend(r); applyFilter();
    } else if ((ev.kind === "permission_requested" || ev.kind === "permission_resolved") && rows.has(d.agent_id)) {
      const a = await api("GET", `/v1/agents/${d.agent_id}`);
      const r = row(a); rows.get(d.agent_id).replaceWith(r); rows.set(a.id, r); applyFilter();
    }
  }, () => {}, signal);
}

// ---------------------------------------------------------------------------------------
// Agent page: the timeline as a conversation, live
// ---------------------------------------------------------------------------------------

function diffBlock(patch) {
  const pre = el("pre", { class: "diff" });
  for (const line of (patch || "").split("\n")) {
    let cls = null;
    if (line.startsWith("diff --git") || line.startsWith("+++") || line.startsWith("---")) cls = "file";
    else if (line.startsWith("@@")) cls = "hunk";
    else if (line.startsWith("+")) cls = "add";
    else if (line.startsWith("-")) cls = "del";
    pre.append(cls ? el("span", { class: cls }, line) : document.createTextNode(line + "\n"));
  }
  return pre;
}

// A tool call's file changes: `[{path, change, unified?, old_text?, new_text?}]`.
function fileDiffs(diffs) {
  if (typeof diffs === "string") return diffBlock(diffs);
  const lines = [];
  for (const f of diffs) {
    lines.push(`--- ${f.path} (${f.change || "edit"})`);
    if (f.unified) { lines.push(...f.unified.split("\n")); continue; }
    for (const l of (f.old_text || "").split("\n")) if (f.old_text) lines.push(`-${l}`);
    for (const l of (f.new_text || "").split("\n")) if (f.new_text) lines.push(`+${l}`);
  }
  return diffBlock(lines.join("\n"));
}

class Timeline {
  constructor(agent, container, setStatus, setUsage) {
    this.agent = agent;
    this.box = container;
    this.setStatus = setStatus;
    this.setUsage = setUsage;
    this.messages = new Map(); // message_id -> element (assistant)
    this.tools = new Map();
    this.permissions = new Map();
    this.reasoning = new Map();
  }

  // Render one event at the end (live) or return its node (for older pages).
  node(ev) {
    const d = ev.data || {};
    switch (ev.kind) {
      case "user_message":
        return el("div", { class: "msg user" }, d.text);
      case "assistant_delta": {
        let m = this.messages.get(d.message_id);
        if (!m) {
          m = el("div", { class: "msg assistant", "data-message": d.message_id });
          this.messages.set(d.message_id, m);
          m.append(document.createTextNode(d.text));
          return m;
        }
        m.append(document.createTextNode(d.text));
        return null;
      }
      case "assistant_message": {
        let m = this.messages.get(d.message_id);
        if (m) { m.textContent = d.text; return null; }
        m = el("div", { class: "msg assistant", "data-message": d.message_id }, d.text);
        this.messages.set(d.message_id, m);
        return m;
      }
      case "reasoning_delta": {
        let r = this.reasoning.get(d.id);
        if (!r) {
          const p = el("p");
          r = el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"), p);
          r.p = p;
          this.reasoning.set(d.id, r);
          p.append(document.createTextNode(d.text));
          return r;
        }
        r.p.append(document.createTextNode(d.text));
        return null;
      }
      case "reasoning": {
        let r = this.reasoning.get(d.id);
        if (r) { r.p.textContent = d.text; return null; }
        const p = el("p", {}, d.text);
        r = el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"), p);
        r.p = p;
        this.reasoning.set(d.id, r);
        return r;
      }
      case "tool_call": {
        const body = [
          el("div", { class: "row" }, el("strong", {}, d.title || d.name), statusBadge(d.status), el("span", { class: "muted" }, d.tool_kind)),
          d.input && d.input.command ? el("pre", {}, String(d.input.command)) : null,
          d.output ? el("pre", {}, typeof d.output === "string" ? d.output : JSON.stringify(d.output, null, 2)) : null,
          d.error ? el("div", { class: "event-error" }, d.error) : null,
          d.diff ? fileDiffs(d.diff) : null,
        ];
        let t = this.tools.get(d.call_id);
        if (t) { t.className = `tool ${d.status}`; t.replaceChildren(...body.filter(Boolean)); return null; }
        t = el("div", { class: `tool ${d.status}`, "data-call": d.call_id }, body);
        this.tools.set(d.call_id, t);
        return t;
      }
      case "permission_requested": {
        const card = el("section", { class: "permission", "aria-label": `Permission: ${d.title}` },
          el("strong", {}, d.title),
          d.input && d.input.command ? el("pre", {}, String(d.input.command)) : null,
          el("div", { class: "row" }, (d.options || []).map((o) => el("button", {
            type: "button",
            class: o.behavior === "allow" ? "primary" : "danger",
            onclick: async (e) => {
              for (const b of card.querySelectorAll("button")) b.disabled = true;
              try {
                await api("POST", `/v1/agents/${this.agent}/permissions/${d.request_id}`, { behavior: o.behavior, option_id: o.id });
              } catch (err) {
                card.append(failure(err));
                for (const b of card.querySelectorAll("button")) b.disabled = false;
              }
            },
          }, o.label))),
        );
        this.permissions.set(d.request_id, card);
        return card;
      }
      case "permission_resolved": {
        const card = this.permissions.get(d.request_id);
        const text = `${d.behavior === "allow" ? "Allowed" : "Denied"}${d.option_id ? ` (${d.option_id})` : ""}${d.message ? `: ${d.message}` : ""}`;
        if (card) {
          for (const b of card.querySelectorAll("button")) b.remove();
          card.append(el("div", { class: "muted" }, text));
          return null;
        }
        return el("div", { class: "muted" }, text);
      }
      case "plan":
        return el("div", { class: "tool" }, el("strong", {}, "Plan"), el("ol", {}, (d.entries || []).map((e) => el("li", {}, `${e.text} — ${e.status}`))));
      case "error":
        return el("div", { class: "event-error" }, d.message);
      case "turn_completed":
        return el("div", { class: `turn-end ${d.outcome}` }, `Turn ${d.outcome}${d.error ? `: ${d.error}` : ""}`);
      case "status":
        this.setStatus(d.status);
        return null;
      case "usage":
        this.setUsage(d);
        return null;
      case "mode_changed":
        return el("div", { class: "note" }, `Mode: ${d.mode}`);
      case "model_changed":
        return el("div", { class: "note" }, `Model: ${d.model}`);
      default:
        return null;
    }
  }

  append(ev) {
    const n = this.node(ev);
    if (n) this.box.append(n);
  }
}

async function agentPage(id, signal) {
  const agent = await api("GET", `/v1/agents/${id}`);
  const status = el("span", { class: `badge ${agent.status}`, role: "status", "aria-live": "polite" }, agent.status);
  const setStatus = (s) => { status.textContent = s; status.className = `badge ${s}`; };
  const usage = el("div", { class: "usage", "aria-label": "Usage" });
  const setUsage = (u) => {
    const parts = [`${u.input_tokens || 0} tokens in`, `${u.output_tokens || 0} out`];
    if (u.cost_usd) parts.push(`$${Number(u.cost_usd).toFixed(4)}`);
    const children = [parts.join(" · ")];
    if (u.context_window_max) {
      children.push(" ", el("meter", { min: 0, max: u.context_window_max, value: u.context_window_used || 0, title: "context window" }));
    }
    usage.replaceChildren(...children);
  };
  const conn = el("span", { class: "conn", "aria-live": "polite" });
  const box = el("div", { class: "timeline", "aria-label": "Timeline" });
  const tl = new Timeline(id, box, setStatus, setUsage);

  // The tail first; older pages on demand (an agent may have 100,000 events).
  const tail = await api("GET", `/v1/agents/${id}/timeline?before_seq=${agent.last_seq + 1}&limit=300`);
  const events = tail.items.slice().reverse();
  let older = tail.next_cursor;
  const more = el("button", { type: "button", onclick: async () => {
    more.disabled = true;
    const page = await api("GET", `/v1/agents/${id}/timeline?cursor=${older}&limit=300`);
    older = page.next_cursor;
    // Older events render into a fresh timeline state, placed before what is shown.
    const prior = new Timeline(id, el("div"), () => {}, () => {});
    const nodes = [];
    for (const ev of page.items.slice().reverse()) { const n = prior.node(ev); if (n) nodes.push(n); }
    more.after(...nodes);
    more.disabled = false;
    more.hidden = !older;
  } }, "Load earlier");
  more.hidden = !older;
  box.append(more);
  // Scrolling up to the top loads the page before it.
  new IntersectionObserver((entries) => {
    if (entries.some((e) => e.isIntersecting) && !more.hidden && !more.disabled && window.scrollY > 0) more.click();
  }).observe(more);
  for (const ev of events) tl.append(ev);
  let last = events.length ? events[events.length - 1].seq : 0;

  // Mode and model pickers.
  const pickers = el("div", { class: "row" });
  try {
    const providers = await api("GET", "/v1/providers");
    const p = providers.items.find((x) => x.id === agent.provider);
    if (p && p.modes && p.modes.length) {
      const sel = el("select", { id: "mode", onchange: async () => {
        try { await api("PUT", `/v1/agents/${id}/mode`, { mode: sel.value }); } catch (e) { pickers.append(failure(e)); }
      } }, p.modes.map((m) => el("option", { value: m.id, selected: m.id === agent.mode }, m.label || m.id)));
      pickers.append(el("label", { for: "mode" }, "Mode"), sel);
    }
    const models = await api("GET", `/v1/providers/${agent.provider}/models`).catch(() => ({ items: [] }));
    if (models.items.length) {
      const sel = el("select", { id: "model", onchange: async () => {
        try { await api("PUT", `/v1/agents/${id}/model`, { model: sel.value }); } catch (e) { pickers.append(failure(e)); }
      } }, models.items.map((m) => el("option", { value: m.id, selected: m.id === agent.model }, m.label || m.id)));
      pickers.append(el("label", { for: "model" }, "Model"), sel);
    }
  } catch (_) { /* pickers are optional */ }

  const input = el("textarea", { id: "message", rows: 2, placeholder: "Ask the agent…" });
  const sendError = el("span", { class: "error-text", role: "alert" });
  const send = async () => {
    const text = input.value.trim();
    if (!text) return;
    sendError.textContent = "";
    try {
      await api("POST", `/v1/agents/${id}/messages`, { text });
      input.value = "";
    } catch (e) { sendError.textContent = e.message; }
  };
  input.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.metaKey || e.ctrlKey)) { e.preventDefault(); send(); } });
  const composer = el("form", { class: "composer", onsubmit: (e) => { e.preventDefault(); send(); } },
    el("div", { class: "inner" },
      el("label", { for: "message" }, "Message"),
      input,
      el("button", { class: "primary", type: "submit" }, "Send"),
      el("button", { type: "button", onclick: async () => {
        try { await api("POST", `/v1/agents/${id}/interrupt`, {}); } catch (e) { sendError.textContent = e.message; }
      } }, "Interrupt"),
      sendError,
    ));

  show(
    el("div", { class: "agent-head" },
      el("div", {},
        el("h1", {}, agent.title || agent.id),
        el("div", { class: "row" }, status, el("span", { class: "muted" }, agent.provider), ...labelChips(agent.labels), conn),
        el("div", { class: "row" }, link(`/workspaces/${agent.workspace_id}`, "Workspace and changes")),
      ),
      el("div", {}, pickers, usage),
    ),
    box,
    composer,
  );
  window.scrollTo(0, document.body.scrollHeight);
  follow(`/v1/agents/${id}/events`, last, (_seq, ev) => {
    const nearBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 120;
    tl.append(ev);
    if (nearBottom) window.scrollTo(0, document.body.scrollHeight);
  }, (up) => { conn.textContent = up ? "" : "reconnecting…"; }, signal);
}

// ---------------------------------------------------------------------------------------
// Workspace page: branch, files changed, the diff, archive
// ---------------------------------------------------------------------------------------

async function workspacePage(id) {
  const ws = await api("GET", `/v1/workspaces/${id}`);
  const parts = [
    el("h1", {}, ws.title || ws.branch || ws.id),
    el("div", { class: "row" }, statusBadge(ws.status), el("span", {}, `Branch ${ws.branch || "—"}`), el("span", { class: "muted" }, ws.path)),
  ];
  if (ws.setup_status) {
    parts.push(el("details", { class: "card" }, el("summary", {}, `Setup ${ws.setup_status}`), el("pre", {}, ws.setup_output || "")));
  }
  if (ws.archived_at) {
    parts.push(el("p", { class: "muted" }, "Archived: its files are gone, the branch is kept."));
  } else {
    const diff = await api("GET", `/v1/workspaces/${id}/diff`);
    parts.push(
      el("h2", {}, "Files changed"),
      diff.files.length
        ? el("ul", { class: "files", "aria-label": "Files changed" }, diff.files.map((f) => el("li", {}, f.path, " ", el("span", { class: "muted" }, `${f.status} +${f.additions} −${f.deletions}`))))
        : el("p", { class: "muted" }, "No changes yet."),
      diff.patch ? diffBlock(diff.patch) : null,
      el("p", {}, el("button", { type: "button", class: "danger", onclick: async (e) => {
        if (!confirm("Archive this workspace? Its agents are closed and the worktree removed; the branch stays.")) return;
        e.target.disabled = true;
        try { await api("POST", `/v1/workspaces/${id}/archive`, {}); route(); } catch (err) { e.target.after(failure(err)); e.target.disabled = false; }
      } }, "Archive")),
    );
  }
  show(...parts);
}

// ---------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------

async function route() {
  if (pageAbort) pageAbort.abort();
  pageAbort = new AbortController();
  const signal = pageAbort.signal;
  try {
    await whoAmI();
  } catch (e) {
    if (e.status !== 401) show(failure(e));
    return;
  }
  const path = location.pathname;
  let m;
  try {
    if ((m = path.match(/^\/agents\/([A-Za-z0-9_]+)$/))) await agentPage(m[1], signal);
    else if ((m = path.match(/^\/workspaces\/([A-Za-z0-9_]+)$/))) await workspacePage(m[1], signal);
    else await homePage(signal);
  } catch (e) {
    if (e.status === 401) return;
    show(el("h1", {}, e.status === 404 ? "Not found" : "Something went wrong"), failure(e), el("p", {}, link("/", "Back to agents")));
  }
  document.getElementById("main").focus({ preventScroll: true });
}

window.addEventListener("popstate", route);
document.addEventListener("DOMContentLoaded", route);
