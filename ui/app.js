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
    this.errors = (problem && problem.errors) || [];
  }
}

function headers(extra) {
  const h = Object.assign({ Accept: "application/json" }, extra || {});
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

async function api(method, path, body) {
  const sent = token;
  const init = { method, headers: headers(), credentials: "same-origin" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401) {
    signedOut(sent);
    throw new ApiError(401, { detail: "signed out" });
  }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new ApiError(res.status, data);
  return data;
}

// Follow an SSE stream with fetch (EventSource cannot send a bearer token), resuming
// with Last-Event-ID after a drop; `onEvent(id, data)` sees each id once, in order.
// `onLive` (optional) runs when the server says its replay is done (`: live`): events
// after that happened after the stream opened.
async function follow(path, after, onEvent, onState, signal, onLive) {
  let last = after;
  let delay = 500;
  while (!signal.aborted) {
    try {
      const sent = token;
      const h = headers({ Accept: "text/event-stream" });
      h["Last-Event-ID"] = String(last);
      const res = await fetch(path, { headers: h, credentials: "same-origin", signal });
      if (res.status === 401) { signedOut(sent); return; }
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
          if (frame === ": live") { if (onLive) onLive(); continue; }
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
  // A new page has not caught up with any stream yet.
  delete main.dataset.live;
}

function failure(e) {
  return el("p", { class: "error-text", role: "alert" }, e.message || String(e));
}

// ---------------------------------------------------------------------------------------
// Sign-in
// ---------------------------------------------------------------------------------------

// `rejected` is the token a request was refused with: a token stored since (a sign-in in
// another tab) is not the one refused, and stays.
function signedOut(rejected = token) {
  if (localStorage.getItem(TOKEN_KEY) === rejected) localStorage.removeItem(TOKEN_KEY);
  token = "";
  if (attention.abort) attention.abort.abort();
  attention.waiting.clear();
  titleCount();
  document.getElementById("pages").replaceChildren();
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
          location.href = `/auth/login?return_to=${encodeURIComponent(location.pathname + location.search)}`;
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
  const pages = document.getElementById("pages");
  if (!pages.childElementCount) {
    const to = (view, path, text) => { const a = link(path, text); a.dataset.view = view; return a; };
    pages.append(to("agents", "/", "Agents"), to("workspaces", "/workspaces", "Workspaces"), to("usage", "/usage", "Usage"), to("team", "/teams", "Team"));
  }
  document.getElementById("who").replaceChildren(notifyToggle(), el("span", { class: "me" }, me.email || me.name || me.id), out);
  return me;
}

// ---------------------------------------------------------------------------------------
// Attention: the tab title counts the agents waiting for an answer; with the person's
// consent, a notification when one of their agents asks or fails while the tab is hidden.
// ---------------------------------------------------------------------------------------

const NOTIFY_KEY = "agentry.notify";
const attention = { waiting: new Set(), me: null, abort: null };

function titleCount() {
  const n = attention.waiting.size;
  document.title = n ? `(${n}) agentry` : "agentry";
}

function notifyToggle() {
  if (!("Notification" in window)) return null;
  const on = () => localStorage.getItem(NOTIFY_KEY) === "on" && Notification.permission === "granted";
  const b = el("button", { type: "button", "aria-pressed": on() ? "true" : "false" }, on() ? "Notifications on" : "Notify me");
  b.addEventListener("click", async () => {
    if (on()) localStorage.setItem(NOTIFY_KEY, "off");
    else if ((await Notification.requestPermission()) === "granted") localStorage.setItem(NOTIFY_KEY, "on");
    b.textContent = on() ? "Notifications on" : "Notify me";
    b.setAttribute("aria-pressed", on() ? "true" : "false");
  });
  return b;
}

function notify(agent, text) {
  if (!document.hidden || !("Notification" in window)) return;
  if (localStorage.getItem(NOTIFY_KEY) !== "on" || Notification.permission !== "granted") return;
  if (attention.me && agent.created_by && agent.created_by !== attention.me.id) return;
  const n = new Notification(`${agent.title || agent.id}: ${text}`, { tag: `agentry-${agent.id}`, body: "agentry" });
  n.onclick = () => { window.focus(); navigate(`/agents/${agent.id}`); };
}

async function watchAttention(me) {
  attention.me = me;
  if (attention.abort && !attention.abort.signal.aborted) return;
  attention.abort = new AbortController();
  const signal = attention.abort.signal;
  // The stream replays its history first: what happened before the page opened counts,
  // but is not announced. The server marks the end of that replay; what comes after it
  // (including what a reconnect replays) is news. `data-attention="live"` on the body
  // says the page has caught up.
  let live = false;
  try {
    for (const a of await all("/v1/agents?status=waiting_permission", 1000)) attention.waiting.add(a.id);
  } catch (_) { /* counted from the stream on */ }
  titleCount();
  follow("/v1/events", 0, (_id, ev) => {
    const d = ev.data || {};
    if (!d.agent_id) return;
    if (ev.kind === "permission_requested") {
      attention.waiting.add(d.agent_id);
      if (live) tellAbout(d.agent_id, "asks for permission");
    } else if (ev.kind === "agent_status") {
      if (d.status === "waiting_permission") attention.waiting.add(d.agent_id);
      else attention.waiting.delete(d.agent_id);
      if (live && d.status === "error") tellAbout(d.agent_id, "failed");
    } else if (ev.kind === "agent_archived") {
      attention.waiting.delete(d.agent_id);
    } else return;
    titleCount();
  }, () => {}, signal, () => {
    live = true;
    document.body.dataset.attention = "live";
  });
}

async function tellAbout(agentId, text) {
  if (!document.hidden || localStorage.getItem(NOTIFY_KEY) !== "on") return;
  const a = await api("GET", `/v1/agents/${agentId}`).catch(() => null);
  if (a) notify(a, text);
}

// ---------------------------------------------------------------------------------------
// Home: projects, workspaces and agents with live status
// ---------------------------------------------------------------------------------------

// Every page of a list (the API gives at most 200 a page), up to `cap` items.
async function all(path, cap = 5000) {
  const sep = path.includes("?") ? "&" : "?";
  let page = await api("GET", `${path}${sep}limit=200`);
  const items = page.items.slice();
  while (page.next_cursor && items.length < cap) {
    page = await api("GET", `${path}${sep}limit=200&cursor=${encodeURIComponent(page.next_cursor)}`);
    items.push(...page.items);
  }
  return items;
}

const needsYou = (a) => a.status === "waiting_permission" || a.pending_permissions > 0;
const NEEDS_FIRST_KEY = "agentry.needs-first";

async function homePage(signal) {
  const started = performance.now();
  const [projects, agents] = await Promise.all([all("/v1/projects"), all("/v1/agents")]);
  const filter = el("input", { id: "filter", type: "search", placeholder: "status, provider or label" });
  const needsFirst = el("input", { id: "needs-first", type: "checkbox", checked: localStorage.getItem(NEEDS_FIRST_KEY) !== "off" });
  const rows = new Map();
  const tbody = el("tbody");
  const row = (a) => {
    const attention = needsYou(a)
      ? el("span", { class: "badge waiting_permission" }, "needs you")
      : a.status === "error" ? el("span", { class: "badge error" }, "failed") : null;
    const tr = el("tr", { "data-agent": a.id },
      el("td", {}, link(`/agents/${a.id}`, a.title || a.id), " ", ...labelChips(a.labels)),
      el("td", {}, statusBadge(a.status), " ", attention),
      el("td", {}, a.provider),
      el("td", { class: "muted" }, new Date(a.created_at).toLocaleString()),
    );
    tr.dataset.search = `${a.status} ${a.provider} ${a.title || ""} ${needsYou(a) ? "needs you" : ""} ${Object.entries(a.labels || {}).map(([k, v]) => `${k}=${v}`).join(" ")}`.toLowerCase();
    tr.dataset.needs = needsYou(a) ? "1" : "";
    tr.dataset.created = a.created_at;
    return tr;
  };
  const frag = document.createDocumentFragment();
  for (const a of agents) { const r = row(a); rows.set(a.id, r); frag.append(r); }
  tbody.append(frag);
  // Newest first, and with "needs you first" the agents waiting for an answer above all.
  const order = () => {
    const list = [...rows.values()].sort((x, y) =>
      (needsFirst.checked ? (y.dataset.needs ? 1 : 0) - (x.dataset.needs ? 1 : 0) : 0)
      || (x.dataset.created < y.dataset.created ? 1 : x.dataset.created > y.dataset.created ? -1 : 0));
    const f = document.createDocumentFragment();
    f.append(...list);
    tbody.append(f);
  };
  const applyFilter = () => {
    const q = filter.value.trim().toLowerCase();
    for (const r of rows.values()) r.hidden = q !== "" && !r.dataset.search.includes(q);
  };
  filter.addEventListener("input", applyFilter);
  needsFirst.addEventListener("change", () => { localStorage.setItem(NEEDS_FIRST_KEY, needsFirst.checked ? "on" : "off"); order(); });
  order();

  const projectList = el("ul", {}, projects.map((p) => el("li", {}, el("strong", {}, p.name), " ", el("span", { class: "muted" }, p.repo_path || p.git_url))));
  show(
    el("div", { class: "row" }, el("h1", { class: "grow" }, "Agents"),
      el("button", { type: "button", class: "primary", onclick: () => navigate("/new") }, "New agent")),
    el("div", { class: "row" }, el("label", { for: "filter" }, "Filter"), filter,
      el("span", { class: "row" }, needsFirst, el("label", { for: "needs-first" }, "Needs you first"))),
    el("table", { class: "agents", "aria-label": "Agents" }, el("thead", {}, el("tr", {}, el("th", {}, "Agent"), el("th", {}, "Status"), el("th", {}, "Provider"), el("th", {}, "Created"))), tbody),
    agents.length ? null : el("p", { class: "muted" }, "No agents yet. Start one with New agent, the API or `agentry run`."),
    el("h2", {}, "Projects"),
    projects.length ? projectList : el("p", { class: "muted" }, "No projects yet."),
  );
  main().dataset.renderMs = String(Math.round(performance.now() - started));
  // Live: the team stream (which replays its history first). Changed agents are fetched
  // in batches: a few one by one, many as one new list.
  const dirty = new Set();
  let flushing = null;
  const put = (a) => {
    const r = row(a);
    if (rows.has(a.id)) rows.get(a.id).replaceWith(r); else tbody.append(r);
    rows.set(a.id, r);
  };
  const flush = async () => {
    const ids = [...dirty];
    dirty.clear();
    if (ids.length > 20) {
      for (const a of await all("/v1/agents")) put(a);
    } else {
      const got = await Promise.all(ids.map((id) => api("GET", `/v1/agents/${id}`).catch(() => null)));
      for (const a of got) if (a && !a.archived_at) put(a);
    }
    order();
    applyFilter();
  };
  // Until the stream's replay is done (`: live`), changed agents are only noted: the list
  // just fetched is current, so the replay ends in one fetch, not a row rebuilt per event.
  // `data-live` on #main says the list has caught up with the stream.
  let live = false;
  const touch = (id) => {
    dirty.add(id);
    if (live && !flushing) {
      flushing = new Promise((r) => setTimeout(r, 150)).then(flush).catch(() => { /* the next change fetches again */ }).finally(() => { flushing = null; if (dirty.size) touch([...dirty][0]); });
    }
  };
  follow("/v1/events", 0, (_id, ev) => {
    const d = ev.data || {};
    if (ev.kind === "agent_created" && !rows.has(d.agent_id)) touch(d.agent_id);
    else if ((ev.kind === "agent_status" || ev.kind === "permission_requested" || ev.kind === "permission_resolved") && rows.has(d.agent_id)) touch(d.agent_id);
  }, () => {}, signal, () => {
    if (live) return;
    live = true;
    const caughtUp = () => { if (!signal.aborted) main().dataset.live = "true"; };
    if (dirty.size) flush().catch(() => {}).finally(caughtUp); else caughtUp();
  });
}

// ---------------------------------------------------------------------------------------
// Forms: a labelled control with its own error line, in the server's words
// ---------------------------------------------------------------------------------------

function field(id, label, control, ...extra) {
  const error = el("p", { class: "field-error", id: `${id}-error`, role: "alert" });
  control.id = id;
  control.setAttribute("aria-describedby", `${id}-error`);
  return { node: el("div", { class: "field" }, el("label", { for: id }, label), el("div", { class: "row" }, control, ...extra), error), control, error };
}

function option(value, text, selected) {
  return el("option", { value, selected: !!selected }, text);
}

// ---------------------------------------------------------------------------------------
// New agent: a worktree workspace (or the given one) and the agent, then its page
// ---------------------------------------------------------------------------------------

// Which field of the form a problem concerns: by the field it names, else by its code.
const AGENT_FIELDS = {
  project_id: "project", workspace_id: "project", base_ref: "branch", branch: "branch",
  provider: "provider", mode: "mode", model: "model", title: "title", prompt: "prompt",
};
const AGENT_CODES = {
  unknown_provider: "provider", provider_unavailable: "provider", sandbox_required: "provider",
  sandbox_unavailable: "mode", prompt_too_large: "prompt", branch_exists: "branch",
  remote_unavailable: "branch", workspace_archived: "project", repository_unavailable: "project",
};

async function newAgentPage(wsId) {
  const [projects, providers, ws] = await Promise.all([
    all("/v1/projects"),
    api("GET", "/v1/providers"),
    wsId ? api("GET", `/v1/workspaces/${wsId}`) : null,
  ]);
  const available = providers.items.filter((p) => p.available);
  const unavailable = providers.items.filter((p) => !p.available);
  const f = {};
  f.project = field("project", "Project", el("select", { required: true, disabled: !!ws },
    projects.map((p) => option(p.id, p.name, ws && ws.project_id === p.id))));
  f.branch = field("branch", "Branch", el("input", { autocomplete: "off", spellcheck: "false", disabled: !!ws }));
  f.provider = field("provider", "Provider", el("select", { required: true }, available.map((p) => option(p.id, p.label || p.id))));
  f.mode = field("mode", "Mode", el("select", {}));
  const refresh = el("button", { type: "button", "aria-label": "Refresh models" }, "Refresh");
  f.model = field("model", "Model", el("select", {}), refresh);
  f.title = field("title", "Title", el("input", { autocomplete: "off" }));
  f.prompt = field("prompt", "Prompt", el("textarea", { rows: 5, placeholder: "What should the agent do? (Ctrl+Enter starts it)" }));
  const start = el("button", { type: "submit", class: "primary" }, "Start");
  const startError = el("p", { class: "field-error", id: "start-error", role: "alert" });

  let branchEdited = false;
  f.branch.control.addEventListener("input", () => { branchEdited = true; });
  const projectChanged = () => {
    if (ws) { f.branch.control.value = ws.branch || ""; return; }
    const p = projects.find((x) => x.id === f.project.control.value);
    if (p && !branchEdited) f.branch.control.value = p.default_branch || "";
  };
  const loadModels = async (again) => {
    const id = f.provider.control.value;
    f.model.error.textContent = "";
    if (!id) { f.model.control.replaceChildren(); return; }
    refresh.disabled = true;
    try {
      const q = new URLSearchParams();
      if (again) q.set("refresh", "true");
      if (ws) q.set("workspace_id", ws.id);
      const models = await api("GET", `/v1/providers/${id}/models?${q}`);
      const kept = f.model.control.value;
      f.model.control.replaceChildren(option("", "Provider default"),
        ...models.items.map((m) => option(m.id, m.label || m.id, kept ? m.id === kept : m.is_default)));
    } catch (e) {
      f.model.error.textContent = e.message;
    } finally { refresh.disabled = false; }
  };
  const providerChanged = () => {
    const p = available.find((x) => x.id === f.provider.control.value);
    const modes = (p && p.modes) || [];
    f.mode.control.replaceChildren(...(modes.length ? modes : [{ id: "", label: "Provider default" }])
      .map((m) => option(m.id, `${m.label || m.id}${m.unattended ? " (runs without asking)" : ""}`, m.id === (p && p.default_mode))));
    f.mode.control.disabled = !modes.length;
    f.model.control.replaceChildren();
    loadModels(false);
  };
  f.project.control.addEventListener("change", projectChanged);
  f.provider.control.addEventListener("change", providerChanged);
  refresh.addEventListener("click", () => loadModels(true));
  projectChanged();
  providerChanged();

  const clear = () => { for (const x of Object.values(f)) x.error.textContent = ""; startError.textContent = ""; };
  const place = (e) => {
    let placed = false;
    for (const fe of e.errors || []) {
      const key = AGENT_FIELDS[fe.field] || AGENT_FIELDS[String(fe.field).split(".").pop()];
      const target = key ? f[key].error : startError;
      target.textContent = target.textContent ? `${target.textContent} ${fe.message}` : fe.message;
      placed = true;
    }
    if (placed) return;
    const key = AGENT_CODES[e.code];
    (key ? f[key].error : startError).textContent = e.message;
  };
  const form = el("form", { class: "card new-agent", "aria-label": "New agent", onsubmit: async (ev) => {
    ev.preventDefault();
    clear();
    if (!f.project.control.value && !ws) { f.project.error.textContent = "Register a project first (POST /v1/projects)."; return; }
    if (!f.provider.control.value) { f.provider.error.textContent = "No provider is available on this server."; return; }
    const body = { provider: f.provider.control.value };
    if (ws) body.workspace_id = ws.id;
    else {
      body.workspace = { project_id: f.project.control.value };
      const branch = f.branch.control.value.trim();
      if (branch) body.workspace.base_ref = branch;
    }
    if (f.mode.control.value) body.mode = f.mode.control.value;
    if (f.model.control.value) body.model = f.model.control.value;
    const title = f.title.control.value.trim();
    if (title) body.title = title;
    const prompt = f.prompt.control.value.trim();
    if (prompt) body.prompt = prompt;
    start.disabled = true;
    try {
      const agent = await api("POST", "/v1/agents", body);
      navigate(`/agents/${agent.id}`);
    } catch (e) {
      place(e);
      start.disabled = false;
    }
  } },
    f.project.node, f.branch.node, f.provider.node,
    unavailable.length
      ? el("div", { class: "muted unavailable" }, el("span", {}, "Not available here:"),
          el("ul", { "aria-label": "Providers not available" },
            unavailable.map((p) => el("li", {}, `${p.label || p.id}: ${p.unavailable_reason || "not available"}`))))
      : null,
    f.mode.node, f.model.node, f.title.node, f.prompt.node,
    el("div", { class: "row" }, start, el("span", { class: "muted" }, ws ? `In workspace ${ws.title || ws.branch}` : "A new worktree workspace is made from the branch.")),
    startError,
  );
  f.prompt.control.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.metaKey || e.ctrlKey)) { e.preventDefault(); form.requestSubmit(); }
  });
  show(el("h1", {}, ws ? "New agent here" : "New agent"), form);
  (ws ? f.provider.control : f.project.control).focus();
}

// ---------------------------------------------------------------------------------------
// Agent page: the timeline as a conversation, live
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Syntax colouring of diffs: a small tokenizer per language (by file extension) that puts
// comments, strings, keywords and numbers in spans with classes; text only, never HTML.
// ---------------------------------------------------------------------------------------

const words = (s) => new Set(s.split(" "));
const C_LIKE_NUMBER = /^(?:0[xob][0-9a-f_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:e[+-]?\d+)?)/i;
const LANGUAGES = {
  rust: {
    keywords: words("as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move mut pub ref return self Self static struct super trait true type unsafe use where while"),
    line: "//", block: ["/*", "*/"], quotes: "\"",
  },
  js: {
    keywords: words("async await break case catch class const continue debugger default delete do else export extends false finally for from function if import in instanceof interface let new null of return static super switch this throw true try type typeof undefined var void while with yield"),
    line: "//", block: ["/*", "*/"], quotes: "\"'`",
  },
  python: {
    keywords: words("and as assert async await break class continue def del elif else except False finally for from global if import in is lambda None nonlocal not or pass raise return self True try while with yield"),
    line: "#", quotes: "\"'",
  },
  go: {
    keywords: words("break case chan const continue default defer else fallthrough false for func go goto if import interface map nil package range return select struct switch true type var"),
    line: "//", block: ["/*", "*/"], quotes: "\"'`",
  },
  shell: {
    keywords: words("case do done elif else esac exit export fi for function if in local return set then until while"),
    line: "#", quotes: "\"'",
  },
  json: { keywords: words("true false null"), quotes: "\"" },
  toml: { keywords: words("true false null yes no"), line: "#", quotes: "\"'" },
  markdown: { markdown: true },
};
const EXTENSIONS = {
  rs: "rust", js: "js", mjs: "js", cjs: "js", jsx: "js", ts: "js", tsx: "js", py: "python",
  go: "go", sh: "shell", bash: "shell", zsh: "shell", json: "json", toml: "toml", yaml: "toml",
  yml: "toml", md: "markdown", markdown: "markdown",
};

function languageOf(path) {
  const name = (path || "").split("/").pop().toLowerCase();
  if (name === "dockerfile" || name === "makefile") return LANGUAGES.shell;
  const ext = name.includes(".") ? name.split(".").pop() : "";
  return LANGUAGES[EXTENSIONS[ext]] || null;
}

// The tokens of one line of code: [class or null, text]. `state.block` carries an open
// block comment to the next line of the same file.
function tokenize(code, lang, state) {
  const out = [];
  const push = (cls, text) => { if (text) out.push([cls, text]); };
  if (lang.markdown) {
    if (/^\s{0,3}#{1,6}\s/.test(code)) { push("tok-kw", code); return out; }
    const parts = code.split(/(`[^`]*`)/);
    for (const part of parts) push(part.startsWith("`") && part.length > 1 ? "tok-str" : null, part);
    return out;
  }
  let i = 0;
  let plain = "";
  const flush = () => { push(null, plain); plain = ""; };
  while (i < code.length) {
    const rest = code.slice(i);
    const opens = !state.block && lang.block && rest.startsWith(lang.block[0]);
    if (state.block || opens) {
      const from = opens ? i + lang.block[0].length : i;
      const end = code.indexOf(lang.block[1], from);
      flush();
      if (end < 0) { state.block = true; push("tok-com", rest); return out; }
      push("tok-com", code.slice(i, end + lang.block[1].length));
      i = end + lang.block[1].length;
      state.block = false;
      continue;
    }
    if (lang.line && rest.startsWith(lang.line)) { flush(); push("tok-com", rest); return out; }
    const ch = code[i];
    if (lang.quotes && lang.quotes.includes(ch)) {
      let j = i + 1;
      while (j < code.length && code[j] !== ch) j += code[j] === "\\" ? 2 : 1;
      flush();
      push("tok-str", code.slice(i, j + 1));
      i = j + 1;
      continue;
    }
    const prev = i > 0 ? code[i - 1] : " ";
    if (/[0-9]/.test(ch) && !/[A-Za-z0-9_]/.test(prev)) {
      const m = rest.match(C_LIKE_NUMBER);
      flush();
      push("tok-num", m[0]);
      i += m[0].length;
      continue;
    }
    if (/[A-Za-z_]/.test(ch) && !/[A-Za-z0-9_]/.test(prev)) {
      const m = rest.match(/^[A-Za-z_][A-Za-z0-9_]*/);
      if (lang.keywords.has(m[0])) { flush(); push("tok-kw", m[0]); } else plain += m[0];
      i += m[0].length;
      continue;
    }
    plain += ch;
    i += 1;
  }
  flush();
  return out;
}

// A unified diff as lines with classes; the code of each line coloured by the language
// of its file.
function diffBlock(patch) {
  const pre = el("pre", { class: "diff" });
  let lang = null;
  let state = { block: false };
  for (const line of (patch || "").split("\n")) {
    let cls = "ctx";
    let m;
    if ((m = line.match(/^diff --git a\/(.*) b\/(.*)$/)) || (m = line.match(/^\+\+\+ (?:b\/)?(.*)$/)) || (m = line.match(/^--- (\S+) \(/))) {
      const path = m[m.length - 1];
      if (path !== "/dev/null") { lang = languageOf(path); state = { block: false }; }
      cls = "file";
    } else if (line.startsWith("---") || line.startsWith("index ") || line.startsWith("new file") || line.startsWith("deleted file")) cls = "file";
    else if (line.startsWith("@@")) cls = "hunk";
    else if (line.startsWith("+")) cls = "add";
    else if (line.startsWith("-")) cls = "del";
    if (cls === "file" || cls === "hunk" || !lang) {
      pre.append(el("span", { class: cls }, line));
      continue;
    }
    const marker = line.slice(0, 1);
    const code = line.slice(1);
    pre.append(el("span", { class: cls }, marker, tokenize(code, lang, state).map(([c, t]) => (c ? el("span", { class: c }, t) : t))));
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
          d.child_agent ? el("div", { class: "row child-agent" }, el("span", { class: "muted" }, "Child agent"), link(`/agents/${d.child_agent}`, d.child_agent)) : null,
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
        if (d.usage) this.setUsage(ev);
        return el("div", { class: `turn-end ${d.outcome}` }, `Turn ${d.outcome}${d.error ? `: ${d.error}` : ""}`);
      case "status":
        this.setStatus(d.status);
        return null;
      case "usage":
        this.setUsage(ev);
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

// ---------------------------------------------------------------------------------------
// Usage: tokens per turn (input and output stacked), the context window in use (a line
// over the bars, and a meter), cost when known — a small SVG drawn from the timeline's
// `usage` events and the usage of each `turn_completed`.
// ---------------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, String(v));
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

const compact = (n) => (n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : n >= 1e4 ? `${Math.round(n / 1e3)}k` : n >= 1e3 ? `${(n / 1e3).toFixed(1)}k` : String(n));
const dollars = (n) => `$${n < 0.01 ? n.toFixed(4) : n.toFixed(2)}`;

class UsageChart {
  constructor(box) {
    this.box = box;
    this.turns = new Map(); // turn id -> {input, output, cost, used, max}
    this.drawn = false;
  }

  add(ev) {
    const key = ev.turn_id || "session";
    const t = this.turns.get(key) || { seq: ev.seq, input: 0, output: 0, cost: null, used: null, max: null };
    t.seq = Math.min(t.seq, ev.seq);
    const u = ev.kind === "turn_completed" ? ev.data.usage : ev.data;
    if (!u) return;
    if (u.input_tokens || u.output_tokens) { t.input = u.input_tokens || 0; t.output = u.output_tokens || 0; }
    if (u.cost_usd !== undefined && u.cost_usd !== null) t.cost = Number(u.cost_usd);
    if (u.context_window_max) { t.max = u.context_window_max; t.used = u.context_window_used || 0; }
    this.turns.set(key, t);
    if (!this.drawn) { this.drawn = true; queueMicrotask(() => { this.drawn = false; this.draw(); }); }
  }

  draw() {
    // In timeline order (older pages may arrive after newer ones).
    const all = [...this.turns.values()].sort((a, b) => a.seq - b.seq);
    const turns = all.slice(-24);
    if (!turns.length) return;
    const last = all.slice().reverse().find((t) => t.max) || null;
    const totalIn = turns.reduce((a, t) => a + t.input, 0);
    const totalOut = turns.reduce((a, t) => a + t.output, 0);
    const costs = turns.filter((t) => t.cost !== null);
    // Providers report cost for the session so far: the latest is the total.
    const cost = costs.length ? costs[costs.length - 1].cost : null;
    const summaryParts = [`${turns.length} turn${turns.length === 1 ? "" : "s"}`, `${compact(totalIn)} tokens in`, `${compact(totalOut)} out`];
    if (cost !== null) summaryParts.push(dollars(cost));
    if (last) summaryParts.push(`context ${Math.round((100 * last.used) / last.max)}% of ${compact(last.max)}`);
    const summary = summaryParts.join(" · ");

    const W = 300, H = 64, pad = 2;
    const slot = (W - pad * 2) / Math.max(turns.length, 8);
    const bar = Math.max(slot * 0.7, 2);
    const peak = Math.max(1, ...turns.map((t) => t.input + t.output));
    const y = (v) => H - pad - (v / peak) * (H - pad * 2);
    const bars = turns.map((t, i) => {
      const x = pad + i * slot + (slot - bar) / 2;
      const label = `Turn ${i + 1}: ${t.input} tokens in, ${t.output} out${t.cost !== null ? `, ${dollars(t.cost)} so far` : ""}${t.max ? `, context ${Math.round((100 * t.used) / t.max)}%` : ""}`;
      return svg("g", { class: "turn" },
        svg("title", {}, label),
        svg("rect", { class: "in", x: x.toFixed(1), y: y(t.input).toFixed(1), width: bar.toFixed(1), height: (H - pad - y(t.input)).toFixed(1) }),
        svg("rect", { class: "out", x: x.toFixed(1), y: y(t.input + t.output).toFixed(1), width: bar.toFixed(1), height: (y(t.input) - y(t.input + t.output)).toFixed(1) }),
      );
    });
    const withContext = turns.map((t, i) => [t, i]).filter(([t]) => t.max);
    const cy = (t) => H - pad - (t.used / t.max) * (H - pad * 2);
    const cx = (i) => pad + i * slot + slot / 2;
    const context = withContext.length
      ? [
          svg("polyline", { class: "context", points: withContext.map(([t, i]) => `${cx(i).toFixed(1)},${cy(t).toFixed(1)}`).join(" ") }),
          ...withContext.map(([t, i]) => svg("circle", { class: "context", cx: cx(i).toFixed(1), cy: cy(t).toFixed(1), r: 2.2 })),
        ]
      : [];
    const titleId = "usage-chart-title";
    const chart = svg("svg", { class: "usage-chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": titleId, preserveAspectRatio: "none" },
      svg("title", { id: titleId }, `Usage per turn: ${summary}`),
      svg("line", { class: "axis", x1: 0, y1: H - pad, x2: W, y2: H - pad }),
      bars,
      context,
    );
    const legend = el("div", { class: "usage-legend" },
      el("span", { class: "key in" }, "input"), el("span", { class: "key out" }, "output"),
      withContext.length ? el("span", { class: "key context" }, "context window") : null);
    const meter = last ? el("meter", { min: 0, max: last.max, value: last.used || 0, title: "context window", "aria-label": "Context window" }) : null;
    this.box.replaceChildren(el("div", { class: "usage-text" }, summary, " ", meter), chart, legend);
  }
}

async function agentPage(id, signal) {
  const agent = await api("GET", `/v1/agents/${id}`);
  const status = el("span", { class: `badge ${agent.status}`, role: "status", "aria-live": "polite" }, agent.status);
  const setStatus = (s) => { status.textContent = s; status.className = `badge ${s}`; };
  const usage = el("div", { class: "usage", "aria-label": "Usage" });
  const chart = new UsageChart(usage);
  const setUsage = (ev) => chart.add(ev);
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
    const prior = new Timeline(id, el("div"), () => {}, setUsage);
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
  // Messages sent while a turn runs wait under the composer until they start.
  const queued = el("ul", { class: "queued", "aria-label": "Queued prompts" });
  let queuedLoad = 0;
  const loadQueued = async () => {
    const mine = ++queuedLoad;
    let items;
    try { items = (await api("GET", `/v1/agents/${id}/messages?state=queued`)).items; } catch (_) { return; }
    if (mine !== queuedLoad) return;
    queued.replaceChildren(...items.map((m) => el("li", {},
      el("span", { class: "muted" }, `${m.position}.`), " ",
      el("span", { class: "grow" }, m.text),
      m.interrupt ? el("span", { class: "label" }, "next") : null,
      el("button", { type: "button", "aria-label": `Cancel queued prompt ${m.position}`, onclick: async () => {
        try { await api("DELETE", `/v1/agents/${id}/messages/${m.id}`); } catch (e) { sendError.textContent = e.message; }
        loadQueued();
      } }, "Cancel"))));
    queued.hidden = !items.length;
  };
  queued.hidden = true;
  const composer = el("form", { class: "composer", onsubmit: (e) => { e.preventDefault(); send(); } },
    el("div", { class: "inner" },
      el("label", { for: "message" }, "Message"),
      input,
      el("button", { class: "primary", type: "submit" }, "Send"),
      el("button", { type: "button", onclick: async () => {
        try { await api("POST", `/v1/agents/${id}/interrupt`, {}); } catch (e) { sendError.textContent = e.message; }
      } }, "Interrupt"),
      sendError,
    ),
    queued);
  loadQueued();

  const tree = await agentTree(agent, signal);

  show(
    el("div", { class: "agent-head" },
      el("div", {},
        el("h1", {}, agent.title || agent.id),
        el("div", { class: "row" }, status, el("span", { class: "muted" }, agent.provider), ...labelChips(agent.labels), conn),
        el("div", { class: "row" }, link(`/workspaces/${agent.workspace_id}`, "Workspace and changes")),
        tree,
      ),
      el("div", {}, pickers, usage),
    ),
    box,
    composer,
  );
  window.scrollTo(0, document.body.scrollHeight);
  follow(`/v1/agents/${id}/events`, last, (_seq, ev) => {
    const nearBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 120;
    if (ev.kind === "message_queued" || ev.kind === "message_dequeued") loadQueued();
    tl.append(ev);
    if (nearBottom) window.scrollTo(0, document.body.scrollHeight);
  }, (up) => { conn.textContent = up ? "" : "reconnecting…"; }, signal);
}

// The agent's place in its tree: a link to the agent that created it, and the agents it
// created (not archived) with their status, kept live from the team stream. Nothing when
// it has neither.
async function agentTree(agent, signal) {
  const list = el("ul", { class: "children", "aria-label": "Children" });
  const items = new Map();
  const item = (a) => {
    const badge = statusBadge(a.status);
    const li = el("li", { "data-child": a.id }, link(`/agents/${a.id}`, a.title || a.id), " ", badge, " ", el("span", { class: "muted" }, a.provider));
    li.badge = badge;
    return li;
  };
  const put = (a) => {
    if (a.parent_agent_id !== agent.id || a.archived_at) return;
    const li = item(a);
    if (items.has(a.id)) items.get(a.id).replaceWith(li); else list.append(li);
    items.set(a.id, li);
  };
  const [parent, children] = await Promise.all([
    agent.parent_agent_id ? api("GET", `/v1/agents/${agent.parent_agent_id}`).catch(() => null) : null,
    all(`/v1/agents?parent_agent_id=${agent.id}`).catch(() => []),
  ]);
  for (const c of children) put(c);
  const parentRow = agent.parent_agent_id
    ? el("div", { class: "row" }, el("span", { class: "muted" }, "Parent"),
        link(`/agents/${agent.parent_agent_id}`, (parent && parent.title) || agent.parent_agent_id),
        parent ? statusBadge(parent.status) : null)
    : null;
  const heading = el("h2", { class: "tree-heading" }, "Children");
  const section = el("section", { class: "tree", "aria-label": "Agent tree" }, parentRow, heading, list);
  const refresh = () => { heading.hidden = list.hidden = items.size === 0; };
  refresh();
  follow("/v1/events", 0, (_id, ev) => {
    const d = ev.data || {};
    if (ev.kind === "agent_created" && d.parent_agent_id === agent.id && !items.has(d.agent_id)) {
      api("GET", `/v1/agents/${d.agent_id}`).then((a) => { put(a); refresh(); }).catch(() => {});
    } else if (ev.kind === "agent_status" && items.has(d.agent_id)) {
      const b = items.get(d.agent_id).badge;
      b.textContent = d.status;
      b.className = `badge ${d.status}`;
    } else if (ev.kind === "agent_archived" && items.has(d.agent_id)) {
      items.get(d.agent_id).remove();
      items.delete(d.agent_id);
      refresh();
    }
  }, () => {}, signal);
  return section;
}

// ---------------------------------------------------------------------------------------
// Workspace page: branch, files changed, the diff, archive
// ---------------------------------------------------------------------------------------

async function archiveWorkspace(ws) {
  if (!confirm(`Archive ${ws.title || ws.branch || ws.id}? Its agents are closed and the worktree removed; the branch stays.`)) return false;
  await api("POST", `/v1/workspaces/${ws.id}/archive`, {});
  return true;
}

async function workspacePage(id) {
  const [ws, agents] = await Promise.all([
    api("GET", `/v1/workspaces/${id}`),
    all(`/v1/agents?workspace_id=${id}&include_archived=true`),
  ]);
  const parts = [
    el("div", { class: "row" }, el("h1", { class: "grow" }, ws.title || ws.branch || ws.id),
      ws.archived_at ? null : el("button", { type: "button", class: "primary", onclick: () => navigate(`/new?workspace=${id}`) }, "New agent here")),
    el("div", { class: "row" }, statusBadge(ws.status), el("span", {}, `Branch ${ws.branch || "—"}`), el("span", { class: "muted" }, ws.path)),
  ];
  if (ws.setup_status) {
    parts.push(el("details", { class: "card" }, el("summary", {}, `Setup ${ws.setup_status}`), el("pre", {}, ws.setup_output || "")));
  }
  parts.push(
    el("h2", {}, "Agents"),
    agents.length
      ? el("ul", { "aria-label": "Agents of this workspace" }, agents.map((a) => el("li", {}, link(`/agents/${a.id}`, a.title || a.id), " ", statusBadge(a.status), needsYou(a) ? el("span", { class: "badge waiting_permission" }, "needs you") : null, " ", el("span", { class: "muted" }, a.provider))))
      : el("p", { class: "muted" }, "No agents in this workspace yet."),
  );
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
        e.target.disabled = true;
        try { if (await archiveWorkspace(ws)) { route(); return; } } catch (err) { e.target.after(failure(err)); }
        e.target.disabled = false;
      } }, "Archive")),
    );
  }
  show(...parts);
}

// The workspaces of every team the person is in: project, branch, setup, agents and how
// many files changed (asked a few at a time, after the list is shown).
async function workspacesPage(signal) {
  const archived = new URLSearchParams(location.search).get("archived") === "1";
  const [workspaces, projects, agents] = await Promise.all([
    all(`/v1/workspaces${archived ? "?include_archived=true" : ""}`, 1000),
    all("/v1/projects"),
    all("/v1/agents"),
  ]);
  const projectName = new Map(projects.map((p) => [p.id, p.name]));
  const agentsOf = new Map();
  for (const a of agents) {
    if (!agentsOf.has(a.workspace_id)) agentsOf.set(a.workspace_id, []);
    agentsOf.get(a.workspace_id).push(a);
  }
  const counts = [];
  const row = (ws) => {
    const name = ws.title || ws.branch || ws.id;
    const mine = agentsOf.get(ws.id) || [];
    const waiting = mine.filter(needsYou).length;
    const changed = el("td", { class: "changed" }, ws.archived_at ? "—" : "…");
    if (!ws.archived_at) counts.push([ws.id, changed]);
    const action = el("td", {});
    const tr = el("tr", { "data-workspace": ws.id },
      el("td", {}, link(`/workspaces/${ws.id}`, name)),
      el("td", {}, projectName.get(ws.project_id) || ws.project_id),
      el("td", {}, ws.branch || "—"),
      el("td", {}, ws.archived_at ? statusBadge("archived") : ws.setup_status ? statusBadge(ws.setup_status) : el("span", { class: "muted" }, "none")),
      el("td", {}, String(mine.length), waiting ? el("span", { class: "badge waiting_permission" }, `${waiting} need${waiting === 1 ? "s" : ""} you`) : null),
      changed,
      action,
    );
    if (!ws.archived_at) {
      action.append(el("button", { type: "button", class: "danger", "aria-label": `Archive ${name}`, onclick: async (e) => {
        e.target.disabled = true;
        try {
          if (await archiveWorkspace(ws)) {
            const now = await api("GET", `/v1/workspaces/${ws.id}`);
            tr.replaceWith(row(now));
            return;
          }
        } catch (err) { action.append(failure(err)); }
        e.target.disabled = false;
      } }, "Archive"));
    }
    return tr;
  };
  const tbody = el("tbody", {}, workspaces.map(row));
  const showArchived = el("input", { id: "show-archived", type: "checkbox", checked: archived, onchange: () => navigate(showArchived.checked ? "/workspaces?archived=1" : "/workspaces") });
  show(
    el("h1", {}, "Workspaces"),
    el("div", { class: "row" }, showArchived, el("label", { for: "show-archived" }, "Show archived")),
    el("table", { "aria-label": "Workspaces" },
      el("thead", {}, el("tr", {}, ["Workspace", "Project", "Branch", "Setup", "Agents", "Changed files", ""].map((h) => el("th", {}, h)))),
      tbody),
    workspaces.length ? null : el("p", { class: "muted" }, "No workspaces yet. New agent makes one."),
  );
  // Changed-file counts, four at a time.
  const next = async () => {
    while (counts.length && !signal.aborted) {
      const [id, cell] = counts.shift();
      try {
        const diff = await api("GET", `/v1/workspaces/${id}/diff`);
        cell.textContent = String(diff.files.length);
      } catch (_) { cell.textContent = "?"; }
    }
  };
  await Promise.all([next(), next(), next(), next()]);
}

// ---------------------------------------------------------------------------------------
// Team page: members, service tokens, secrets, hooks and the audit log of one team
// ---------------------------------------------------------------------------------------

const TEAM_KEY = "agentry.team";
const ROLES = ["viewer", "member", "owner"];
const HOOK_POINTS = [
  "workspace.create.before", "worktree.create.before", "worktree.create.after",
  "agent.create.before", "agent.open.before", "workspace.create.after", "workspace.archive.after",
  "agent.create.after", "agent.close.after", "agent.archive.after", "agent.turn.before",
  "agent.turn.after", "agent.permission.before", "agent.permission.after", "budget.threshold",
];
const AUDIT_ACTIONS = [
  "agent.create", "agent.prompt", "agent.interrupt", "agent.archive", "permission.answer",
  "workspace.create", "workspace.archive", "project.create", "project.delete", "team.create",
  "member.add", "member.remove", "member.role", "token.create", "token.revoke", "user.create",
  "secret.set", "secret.delete", "auth.sign_in", "network.set", "team.sandbox", "budget.set",
  "hook.create", "hook.update", "hook.delete", "hook.fail", "team.agentry_mcp",
  "workspace.push", "workspace.pull_request", "trigger.create", "trigger.update",
  "trigger.delete", "trigger.run",
];

// A section that can reload itself: `render()` answers its nodes.
function section(title, render) {
  const box = el("section", { class: "card team-section", "aria-label": title });
  let latest = 0;
  const load = async () => {
    // Only the newest of overlapping loads is shown.
    const mine = ++latest;
    let nodes;
    try { nodes = (await render(load)).filter(Boolean); } catch (e) { nodes = [failure(e)]; }
    if (mine === latest) box.replaceChildren(el("h2", {}, title), ...nodes);
  };
  return { box, load };
}

function when(t) {
  return t ? new Date(t).toLocaleString() : "—";
}

// The team a page shows: the one in its address; without one, the last one shown, the
// person's default or their first (and the address then names it).
function chosenTeam(me, asked, path) {
  const teams = me.teams || [];
  const team = asked
    ? teams.find((t) => t.id === asked)
    : teams.find((t) => t.id === localStorage.getItem(TEAM_KEY)) || teams.find((t) => t.id === me.default_team_id) || teams[0];
  if (!team) return null;
  if (!asked) history.replaceState(null, "", path(team.id));
  return team;
}

const notFound = () => Object.assign(new Error("No such team among yours."), { status: 404 });

async function teamPage(me, asked) {
  const teams = me.teams || [];
  if (!teams.length && !asked) { show(el("h1", {}, "Team"), el("p", { class: "muted" }, "You are in no team.")); return; }
  const team = chosenTeam(me, asked, (id) => `/teams/${id}`);
  if (!team) throw notFound();
  localStorage.setItem(TEAM_KEY, team.id);
  const owner = team.role === "owner" || me.is_admin;
  const switcher = teams.length > 1
    ? el("div", { class: "row" }, el("label", { for: "team-switch" }, "Team"),
        el("select", { id: "team-switch", onchange: (e) => navigate(`/teams/${e.target.value}`) },
          teams.map((t) => option(t.id, `${t.name} (${t.role})`, t.id === team.id))))
    : null;
  const onlyOwners = el("p", { class: "muted" }, "Only the team's owners manage this.");

  // Members
  const members = section("Members", async (reload) => {
    const list = await all(`/v1/teams/${team.id}/members`, 1000);
    const owners = list.filter((m) => m.role === "owner").length;
    const rows = list.map((m) => {
      const who = m.email || m.name || m.user_id;
      const err = el("span", { class: "error-text", role: "alert" });
      const role = owner
        ? el("select", { "aria-label": `Role of ${who}`, onchange: async (e) => {
            err.textContent = "";
            try { await api("PUT", `/v1/teams/${team.id}/members/${m.user_id}`, { role: e.target.value }); reload(); } catch (x) { err.textContent = x.message; e.target.value = m.role; }
          } }, ROLES.map((r) => option(r, r, r === m.role)))
        : m.role;
      const last = m.role === "owner" && owners === 1;
      const remove = owner || m.user_id === me.id
        ? el("button", { type: "button", class: "danger", "aria-label": m.user_id === me.id ? "Leave the team" : `Remove ${who}`, disabled: last,
            title: last ? "The last owner cannot be removed: make someone else an owner first." : null,
            onclick: async () => {
              err.textContent = "";
              try { await api("DELETE", `/v1/teams/${team.id}/members/${m.user_id}`); reload(); } catch (x) { err.textContent = x.message; }
            } }, m.user_id === me.id ? "Leave" : "Remove")
        : null;
      return el("tr", { "data-member": m.user_id }, el("td", {}, m.name || ""), el("td", {}, m.email || ""), el("td", {}, role), el("td", {}, remove, " ", err));
    });
    const email = el("input", { id: "member-email", type: "email", autocomplete: "off", required: true });
    const newRole = el("select", { id: "member-role" }, ROLES.map((r) => option(r, r, r === "member")));
    const msg = el("p", { class: "field-error", role: "alert" });
    const add = owner ? el("form", { class: "row", onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      try {
        const found = await api("GET", `/v1/users?email=${encodeURIComponent(email.value.trim())}`);
        if (!found.items.length) { msg.textContent = "Nobody with this email has an account on this server."; return; }
        await api("PUT", `/v1/teams/${team.id}/members/${found.items[0].id}`, { role: newRole.value });
        reload();
      } catch (x) { msg.textContent = x.message; }
    } }, el("label", { for: "member-email" }, "Member email"), email, el("label", { for: "member-role" }, "Member role"), newRole,
      el("button", { type: "submit" }, "Add member")) : null;
    return [
      el("table", { "aria-label": "Members" }, el("thead", {}, el("tr", {}, ["Name", "Email", "Role", ""].map((h) => el("th", {}, h)))), el("tbody", {}, rows)),
      owners === 1 ? el("p", { class: "muted" }, "A team keeps at least one owner: the last one can be neither removed nor demoted.") : null,
      add, msg,
    ];
  });

  // Service tokens: the secret once, then only its prefix.
  const fresh = el("div", { "aria-live": "polite" });
  const tokens = section("Service tokens", async (reload) => {
    const list = await all(`/v1/tokens?team_id=${team.id}`);
    const rows = list.map((t) => el("tr", { "data-token": t.id },
      el("td", {}, t.name), el("td", {}, el("code", {}, `${t.prefix}…`)), el("td", {}, t.role || ""),
      el("td", {}, (t.scopes || []).join(", ") || "all"), el("td", { class: "muted" }, when(t.last_used_at)),
      el("td", {}, owner ? el("button", { type: "button", class: "danger", "aria-label": `Revoke ${t.name}`, onclick: async (e) => {
        e.target.disabled = true;
        try { await api("DELETE", `/v1/tokens/${t.id}`); reload(); } catch (x) { e.target.after(failure(x)); e.target.disabled = false; }
      } }, "Revoke") : null)));
    const name = el("input", { id: "token-name", autocomplete: "off", required: true });
    const role = el("select", { id: "token-role" }, ROLES.map((r) => option(r, r, r === "member")));
    const msg = el("p", { class: "field-error", role: "alert" });
    const create = owner ? el("form", { class: "row", onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      try {
        const t = await api("POST", "/v1/tokens", { name: name.value.trim(), team_id: team.id, role: role.value });
        name.value = "";
        const secret = el("input", { id: "token-secret", readonly: true, value: t.token, spellcheck: "false", size: 40 });
        const copied = el("span", { class: "ok-text", "aria-live": "polite" });
        fresh.replaceChildren(el("div", { class: "card secret-once", role: "region", "aria-label": "New token" },
          el("p", {}, el("strong", {}, `Token ${t.name} created.`), " Copy its secret now: it is shown this once and never again."),
          el("div", { class: "row" }, el("label", { for: "token-secret" }, "Token secret"), secret,
            el("button", { type: "button", onclick: async () => {
              try { await navigator.clipboard.writeText(t.token); } catch (_) { secret.select(); document.execCommand("copy"); }
              copied.textContent = "Copied";
            } }, "Copy"),
            el("button", { type: "button", onclick: () => fresh.replaceChildren() }, "Done"), copied)));
        reload();
      } catch (x) { msg.textContent = x.message; }
    } }, el("label", { for: "token-name" }, "Token name"), name, el("label", { for: "token-role" }, "Token role"), role,
      el("button", { type: "submit" }, "Create token")) : null;
    return [
      el("p", { class: "muted" }, "Tokens for CI and bots, acting in this team with their role."),
      list.length
        ? el("table", { "aria-label": "Service tokens" }, el("thead", {}, el("tr", {}, ["Name", "Prefix", "Role", "Scopes", "Last used", ""].map((h) => el("th", {}, h)))), el("tbody", {}, rows))
        : el("p", { class: "muted" }, "No service tokens."),
      fresh, create, msg,
    ];
  });

  // Team secrets: names only.
  const secrets = section("Secrets", async (reload) => {
    const list = await all(`/v1/teams/${team.id}/secrets`);
    const rows = list.map((x) => el("tr", { "data-secret": x.name },
      el("td", {}, el("code", {}, x.name)), el("td", { class: "muted" }, when(x.updated_at)),
      el("td", {}, owner ? el("button", { type: "button", class: "danger", "aria-label": `Delete secret ${x.name}`, onclick: async (e) => {
        e.target.disabled = true;
        try { await api("DELETE", `/v1/teams/${team.id}/secrets/${encodeURIComponent(x.name)}`); reload(); } catch (err) { e.target.after(failure(err)); e.target.disabled = false; }
      } }, "Delete") : null)));
    const name = el("input", { id: "secret-name", autocomplete: "off", spellcheck: "false", required: true, placeholder: "ANTHROPIC_API_KEY" });
    const value = el("input", { id: "secret-value", type: "password", autocomplete: "new-password", required: true });
    const msg = el("p", { class: "field-error", role: "alert" });
    const set = owner ? el("form", { class: "row", onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      try {
        await api("PUT", `/v1/teams/${team.id}/secrets/${encodeURIComponent(name.value.trim())}`, { value: value.value });
        value.value = "";
        reload();
      } catch (x) { msg.textContent = x.message; }
    } }, el("label", { for: "secret-name" }, "Secret name"), name, el("label", { for: "secret-value" }, "Secret value"), value,
      el("button", { type: "submit" }, "Set secret")) : null;
    return [
      el("p", { class: "muted" }, "Values are write-only: nobody can read them back."),
      list.length
        ? el("table", { "aria-label": "Secrets" }, el("thead", {}, el("tr", {}, ["Name", "Updated", ""].map((h) => el("th", {}, h)))), el("tbody", {}, rows))
        : el("p", { class: "muted" }, "No secrets."),
      set, msg,
    ];
  });

  // Hooks, with their deliveries.
  const hooks = section("Hooks", async (reload) => {
    if (!owner) return [onlyOwners];
    const list = (await all("/v1/hooks")).filter((h) => h.team_id === team.id);
    const shown = el("div", {});
    const deliveries = async (h) => {
      const items = (await api("GET", `/v1/hooks/${h.id}/deliveries?limit=50`)).items;
      const again = () => deliveries(h).catch((x) => shown.replaceChildren(failure(x)));
      // While a delivery is on its way, look again shortly.
      if (items.some((d) => d.status === "pending")) {
        setTimeout(() => { if (box.isConnected) again(); }, 1500);
      }
      const box = el("section", { class: "card", "aria-label": `Deliveries of ${h.name}` },
        el("div", { class: "row" }, el("h3", { class: "grow" }, `Deliveries of ${h.name}`), el("button", { type: "button", onclick: again }, "Refresh deliveries")),
        items.length
          ? el("table", {}, el("thead", {}, el("tr", {}, ["When", "Event", "Status", "Attempts", "Answer", ""].map((x) => el("th", {}, x)))),
              el("tbody", {}, items.map((d) => el("tr", { "data-delivery": d.id },
                el("td", { class: "muted" }, when(d.created_at)), el("td", {}, d.hook), el("td", {}, statusBadge(d.status)),
                el("td", {}, String(d.attempts)),
                el("td", {}, d.response_status ? `HTTP ${d.response_status}` : "", d.error ? el("span", { class: "error-text" }, ` ${d.error}`) : null,
                  d.duration_ms !== null && d.duration_ms !== undefined ? el("span", { class: "muted" }, ` ${d.duration_ms} ms`) : null),
                el("td", {}, el("button", { type: "button", onclick: async (e) => {
                  e.target.disabled = true;
                  try { await api("POST", `/v1/hooks/${h.id}/deliveries/${d.id}/redeliver`, {}); await again(); } catch (x) { e.target.after(failure(x)); e.target.disabled = false; }
                } }, "Redeliver"))))))
          : el("p", { class: "muted" }, "No deliveries yet."));
      shown.replaceChildren(box);
    };
    const rows = list.map((h) => {
      const enabled = el("input", { type: "checkbox", checked: h.enabled, disabled: h.source === "settings", "aria-label": `Enabled ${h.name}`, onchange: async (e) => {
        // Disabled until the server has it, so a reload or a second click never races the save.
        e.target.disabled = true;
        try { await api("PATCH", `/v1/hooks/${h.id}`, { enabled: e.target.checked }); } catch (x) { e.target.checked = !e.target.checked; e.target.after(failure(x)); }
        e.target.disabled = false;
      } });
      return el("tr", { "data-hook": h.id },
        el("td", {}, h.name, h.source === "settings" ? el("span", { class: "muted" }, " (settings file)") : null),
        el("td", {}, el("code", {}, h.url)), el("td", {}, h.events.join(", ")), el("td", {}, enabled),
        el("td", {}, el("button", { type: "button", onclick: () => deliveries(h).catch((x) => shown.replaceChildren(failure(x))) }, `Deliveries of ${h.name}`)));
    });
    const name = el("input", { id: "hook-name", autocomplete: "off", required: true });
    const url = el("input", { id: "hook-url", type: "url", autocomplete: "off", required: true, placeholder: "https://bots.example.com/agentry" });
    const secret = el("input", { id: "hook-secret", type: "password", autocomplete: "new-password", required: true });
    const boxes = HOOK_POINTS.map((p) => el("label", { class: "check" }, el("input", { type: "checkbox", value: p }), ` ${p}`));
    const msg = el("p", { class: "field-error", role: "alert" });
    const create = el("form", { class: "hook-form", onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      const events = boxes.map((b) => b.querySelector("input")).filter((i) => i.checked).map((i) => i.value);
      try {
        await api("POST", "/v1/hooks", { name: name.value.trim(), url: url.value.trim(), secret: secret.value, events, team_id: team.id });
        reload();
      } catch (x) { msg.textContent = (x.errors || []).map((fe) => `${fe.field}: ${fe.message}`).join(" ") || x.message; }
    } },
      el("div", { class: "row" }, el("label", { for: "hook-name" }, "Hook name"), name, el("label", { for: "hook-url" }, "URL"), url, el("label", { for: "hook-secret" }, "Signing secret"), secret),
      el("fieldset", {}, el("legend", {}, "Events"), el("div", { class: "checks" }, boxes)),
      el("button", { type: "submit" }, "Create hook"), msg);
    return [
      list.length
        ? el("table", { "aria-label": "Hooks" }, el("thead", {}, el("tr", {}, ["Name", "URL", "Events", "Enabled", ""].map((x) => el("th", {}, x)))), el("tbody", {}, rows))
        : el("p", { class: "muted" }, "No hooks."),
      shown, create,
    ];
  });

  // The audit log: newest first, filtered by action and person, a page at a time.
  const audit = section("Audit", async () => {
    if (!owner) return [onlyOwners];
    const people = await all(`/v1/teams/${team.id}/members`, 1000).catch(() => []);
    const bots = await all(`/v1/tokens?team_id=${team.id}`).catch(() => []);
    const action = el("select", { id: "audit-action" }, option("", "Any action"), AUDIT_ACTIONS.map((a) => option(a, a)));
    const person = el("select", { id: "audit-person" }, option("", "Anyone"),
      people.map((m) => option(m.user_id, m.email || m.name || m.user_id)), bots.map((t) => option(t.id, `${t.name} (service token)`)));
    const body = el("tbody");
    const older = el("button", { type: "button" }, "Older");
    const newer = el("button", { type: "button" }, "Newer");
    const cursors = [null];
    let next = null;
    // Filters changed quickly start loads that may answer out of order: only the last
    // one started is shown.
    let latest = 0;
    const load = async () => {
      const mine = ++latest;
      const q = new URLSearchParams({ team_id: team.id, limit: "50" });
      if (action.value) q.set("action", action.value);
      if (person.value) q.set("actor_id", person.value);
      const cursor = cursors[cursors.length - 1];
      if (cursor) q.set("cursor", cursor);
      const page = await api("GET", `/v1/audit?${q}`);
      if (mine !== latest) return;
      next = page.next_cursor;
      body.replaceChildren(...page.items.map((a) => el("tr", { "data-audit": a.id },
        el("td", { class: "muted" }, when(a.at)),
        el("td", {}, (a.actor && (a.actor.email || a.actor.id)) || ""),
        el("td", {}, a.action),
        el("td", {}, a.target ? `${a.target.kind} ${a.target.id || ""}` : ""),
        el("td", {}, el("code", { class: "details" }, a.details ? JSON.stringify(a.details) : "")))));
      if (!page.items.length) body.append(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "No entries.")));
      older.disabled = !next;
      newer.disabled = cursors.length < 2;
    };
    const restart = () => { cursors.length = 1; load().catch((x) => body.replaceChildren(el("tr", {}, el("td", { colspan: 5 }, failure(x))))); };
    action.addEventListener("change", restart);
    person.addEventListener("change", restart);
    older.addEventListener("click", () => { if (next) { cursors.push(next); load(); } });
    newer.addEventListener("click", () => { if (cursors.length > 1) { cursors.pop(); load(); } });
    await load();
    return [
      el("div", { class: "row" }, el("label", { for: "audit-action" }, "Action"), action, el("label", { for: "audit-person" }, "Person"), person,
        el("button", { type: "button", onclick: restart }, "Refresh audit log")),
      el("table", { "aria-label": "Audit" }, el("thead", {}, el("tr", {}, ["When", "Who", "Action", "Target", "Details"].map((x) => el("th", {}, x)))), body),
      el("div", { class: "row" }, newer, older),
    ];
  });

  show(el("h1", {}, `Team ${team.name}`), switcher, el("p", { class: "muted" }, `Your role: ${team.role || (me.is_admin ? "server admin" : "—")}`),
    members.box, tokens.box, secrets.box, hooks.box, audit.box);
  await Promise.all([members.load(), tokens.load(), secrets.load(), hooks.load(), audit.load()]);
}

// ---------------------------------------------------------------------------------------
// Device page: approve or deny a device sign-in (`agentry login` shows the code and links
// here with ?code=); approving gives that client a new token of yours.
// ---------------------------------------------------------------------------------------

async function devicePage(me) {
  const given = new URLSearchParams(location.search).get("code") || "";
  const input = el("input", { id: "user-code", autocomplete: "off", spellcheck: "false", autocapitalize: "characters", value: given, placeholder: "XXXX-XXXX" });
  const result = el("div", { "aria-live": "polite" });
  const lookUp = async () => {
    const code = input.value.trim();
    if (!code) return;
    result.replaceChildren(el("p", { class: "muted" }, "Looking the code up…"));
    let request;
    try {
      request = await api("GET", `/v1/auth/device?user_code=${encodeURIComponent(code)}`);
    } catch (e) {
      const why = e.status === 404 ? "No sign-in is waiting for this code. Check it, or start again in the terminal."
        : e.code === "expired_token" ? "This code expired. Run the sign-in again in the terminal." : e.message;
      result.replaceChildren(el("p", { class: "error-text", role: "alert" }, why));
      return;
    }
    const answered = (text, cls) => result.replaceChildren(el("p", { class: cls, role: "status" }, text));
    if (request.status !== "pending") {
      answered(request.status === "approved" ? "This sign-in was already approved." : `This sign-in was already ${request.status}.`, "muted");
      return;
    }
    const answer = async (verb, done) => {
      for (const b of card.querySelectorAll("button")) b.disabled = true;
      try {
        await api("POST", `/v1/auth/device/${verb}`, { user_code: request.user_code });
        answered(done, verb === "approve" ? "ok-text" : "muted");
      } catch (e) {
        card.append(failure(e));
        for (const b of card.querySelectorAll("button")) b.disabled = false;
      }
    };
    const card = el("section", { class: "card device-request", "aria-label": "Sign-in request" },
      el("p", {}, el("strong", {}, request.client_name), " asks to sign in as ", el("strong", {}, me.email || me.name)),
      el("p", { class: "device-code", "aria-label": "Code" }, request.user_code),
      el("p", { class: "muted" }, "Approve only if this is the code your terminal shows. The device gets a new API token of yours, listed with your tokens, where you can revoke it."),
      el("p", { class: "muted" }, `The code expires at ${new Date(request.expires_at).toLocaleTimeString()}.`),
      el("div", { class: "row" },
        el("button", { type: "button", class: "primary", onclick: () => answer("approve", "Approved. The device is signed in; you can return to it.") }, "Approve"),
        el("button", { type: "button", class: "danger", onclick: () => answer("deny", "Denied. The device was not signed in.") }, "Deny")),
    );
    result.replaceChildren(card);
  };
  const form = el("form", { class: "row", onsubmit: (e) => { e.preventDefault(); lookUp(); } },
    el("label", { for: "user-code" }, "Code"), input, el("button", { type: "submit" }, "Continue"));
  show(el("section", { class: "device" },
    el("h1", {}, "Sign in a device"),
    el("p", { class: "muted" }, "Enter the code shown by ", el("code", {}, "agentry login"), " (or another client) to let it act as you."),
    form,
    result,
  ));
  if (given) await lookUp();
}

// ---------------------------------------------------------------------------------------
// Usage page: a team's spend over time (an SVG drawn here, no outside script), by person
// and by provider, and its budget with what is left
// ---------------------------------------------------------------------------------------

const tokens = (t) => t.input_tokens + t.output_tokens;

function usageTable(name, first, groups, label) {
  const rows = groups.map((g) => el("tr", {},
    el("td", { class: "key" }, label(g.key)),
    el("td", {}, String(g.turns)),
    el("td", {}, compact(tokens(g))),
    el("td", {}, dollars(g.cost_usd), g.estimated_cost_usd > 0 ? el("span", { class: "muted" }, " (estimated in part)") : null)));
  return el("table", { "aria-label": name },
    el("thead", {}, el("tr", {}, el("th", {}, first), el("th", {}, "Turns"), el("th", {}, "Tokens"), el("th", {}, "Cost"))),
    el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 4, class: "muted" }, "Nothing yet."))));
}

// One bar per day of the period, its height the day's cost.
function spendChart(days, from, to) {
  const byDay = new Map(days.map((d) => [d.key, d]));
  const all = [];
  for (let t = new Date(from); t < to; t = new Date(t.getTime() + 86400000)) all.push(t.toISOString().slice(0, 10));
  const W = 600, H = 120, pad = 4;
  const slot = (W - pad * 2) / Math.max(all.length, 1);
  const bar = Math.max(slot * 0.7, 1);
  const peak = Math.max(0.0001, ...days.map((d) => d.cost_usd));
  const total = days.reduce((a, d) => a + d.cost_usd, 0);
  const bars = all.map((day, i) => {
    const d = byDay.get(day);
    const cost = d ? d.cost_usd : 0;
    const h = (cost / peak) * (H - pad * 2);
    const x = pad + i * slot + (slot - bar) / 2;
    return svg("g", { class: "day" },
      svg("title", {}, `${day}: ${dollars(cost)}${d ? `, ${d.turns} turn${d.turns === 1 ? "" : "s"}` : ""}`),
      svg("rect", { class: "spend", x: x.toFixed(1), y: (H - pad - h).toFixed(1), width: bar.toFixed(1), height: h.toFixed(1) }));
  });
  const titleId = "spend-chart-title";
  return svg("svg", { class: "spend-chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": titleId, preserveAspectRatio: "none" },
    svg("title", { id: titleId }, `Spend over time: ${dollars(total)} from ${all[0] || ""} to ${all[all.length - 1] || ""}`),
    svg("line", { class: "axis", x1: 0, y1: H - pad, x2: W, y2: H - pad }),
    bars);
}

function budgetView(b) {
  const parts = [];
  const line = (name, used, max, fmt) => {
    const left = Math.max(0, max - used);
    return el("div", { class: "budget-line" },
      el("meter", { min: 0, max, value: Math.min(used, max), low: max * 0.8, high: max * 0.99, optimum: 0, "aria-label": `${name} used` }),
      el("span", { "aria-label": `${name} left` }, `${fmt(left)} left of ${fmt(max)}`),
      el("span", { class: "muted" }, ` (${fmt(used)} used)`));
  };
  if (b.max_cost_usd !== null && b.max_cost_usd !== undefined) parts.push(line("Cost budget", b.used_cost_usd, b.max_cost_usd, dollars));
  if (b.max_tokens !== null && b.max_tokens !== undefined) parts.push(line("Token budget", b.used_tokens, b.max_tokens, (n) => `${compact(n)} tokens`));
  if (!parts.length) parts.push(el("p", { class: "muted" }, `No budget: ${dollars(b.used_cost_usd)} and ${compact(b.used_tokens)} tokens used this month.`));
  else parts.push(el("p", { class: "muted" }, `The month resets ${when(b.resets_at)}.`));
  return parts;
}

async function usagePage(me, asked) {
  const teams = me.teams || [];
  if (!teams.length && !asked) { show(el("h1", {}, "Usage"), el("p", { class: "muted" }, "You are in no team.")); return; }
  const team = chosenTeam(me, asked, (id) => `/teams/${id}/usage`);
  if (!team) throw notFound();
  const switcher = teams.length > 1
    ? el("div", { class: "row" }, el("label", { for: "usage-team" }, "Team"),
        el("select", { id: "usage-team", onchange: (e) => navigate(`/teams/${e.target.value}/usage`) },
          teams.map((t) => option(t.id, t.name, t.id === team.id))))
    : null;
  const now = new Date();
  const from = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1));
  const q = `/v1/usage?team_id=${team.id}&from=${from.toISOString().slice(0, 10)}`;
  const [days, people, providers, budget, members] = await Promise.all([
    api("GET", `${q}&group_by=day`),
    api("GET", `${q}&group_by=person`),
    api("GET", `${q}&group_by=provider`),
    api("GET", `/v1/teams/${team.id}/budget`),
    all(`/v1/teams/${team.id}/members`, 1000).catch(() => []),
  ]);
  const names = new Map(members.map((m) => [m.user_id, m.email || m.name]));
  if (me.id && !names.has(me.id)) names.set(me.id, me.email || me.name || me.id);
  const person = (key) => names.get(key) || (key.startsWith("tok_") ? `${key} (service token)` : key || "—");
  const t = days.totals;
  const figure = (name, value) => el("div", { class: "figure", role: "group", "aria-label": name },
    el("div", { class: "muted" }, name), el("strong", {}, value));
  show(
    el("h1", {}, `Usage of ${team.name}`),
    switcher,
    el("section", { class: "card", "aria-label": "This month" },
      el("h2", {}, "This month"),
      el("div", { class: "figures" },
        figure("Spend", dollars(t.cost_usd)),
        figure("Turns", String(t.turns)),
        figure("Tokens in", compact(t.input_tokens)),
        figure("Tokens out", compact(t.output_tokens))),
      t.estimated_cost_usd > 0 ? el("p", { class: "muted" }, `${dollars(t.estimated_cost_usd)} of it estimated from the price table.`) : null),
    el("section", { class: "card", "aria-label": "Spend over time" },
      el("h2", {}, "Spend over time"),
      spendChart(days.groups, from, new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate() + 1)))),
    el("section", { class: "card", "aria-label": "Budget" }, el("h2", {}, "Budget"), ...budgetView(budget)),
    el("section", { "aria-label": "By person" }, el("h2", {}, "By person"), usageTable("By person", "Person", people.groups, person)),
    el("section", { "aria-label": "By provider" }, el("h2", {}, "By provider"), usageTable("By provider", "Provider", providers.groups, (k) => k || "—")),
  );
}

// ---------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------

// The addresses pages had before they had paths of their own (`/?view=team&team=<id>`
// and the like), so that old links and bookmarks still lead to the same page.
function oldAddress(path, params) {
  const view = params.get("view");
  if (path !== "/" || !view) return null;
  const team = params.get("team");
  const ws = params.get("workspace");
  switch (view) {
    case "workspaces": return params.get("archived") === "1" ? "/workspaces?archived=1" : "/workspaces";
    case "team": return team ? `/teams/${encodeURIComponent(team)}` : "/teams";
    case "usage": return team ? `/teams/${encodeURIComponent(team)}/usage` : "/usage";
    case "new": return ws ? `/new?workspace=${encodeURIComponent(ws)}` : "/new";
    default: return "/";
  }
}

async function route() {
  if (pageAbort) pageAbort.abort();
  pageAbort = new AbortController();
  const signal = pageAbort.signal;
  let me;
  try {
    me = await whoAmI();
  } catch (e) {
    if (e.status !== 401) show(failure(e));
    return;
  }
  watchAttention(me);
  const older = oldAddress(location.pathname, new URLSearchParams(location.search));
  if (older) history.replaceState(null, "", older);
  const path = location.pathname;
  const params = new URLSearchParams(location.search);
  const view = path === "/" ? "agents"
    : path === "/workspaces" ? "workspaces"
    : path === "/usage" || /^\/teams\/[^/]+\/usage$/.test(path) ? "usage"
    : path === "/teams" || /^\/teams\/[^/]+$/.test(path) ? "team"
    : null;
  for (const a of document.querySelectorAll("#pages a")) {
    if (a.dataset.view === view) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  let m;
  try {
    if ((m = path.match(/^\/agents\/([A-Za-z0-9_]+)$/))) await agentPage(m[1], signal);
    else if ((m = path.match(/^\/workspaces\/([A-Za-z0-9_]+)$/))) await workspacePage(m[1], signal);
    else if (path === "/workspaces") await workspacesPage(signal);
    else if (path === "/device") await devicePage(me);
    else if (path === "/new") await newAgentPage(params.get("workspace"));
    else if (path === "/teams") await teamPage(me, null);
    else if ((m = path.match(/^\/teams\/([A-Za-z0-9_]+)$/))) await teamPage(me, m[1]);
    else if (path === "/usage") await usagePage(me, null);
    else if ((m = path.match(/^\/teams\/([A-Za-z0-9_]+)\/usage$/))) await usagePage(me, m[1]);
    else if (path === "/") await homePage(signal);
    else throw Object.assign(new Error("There is no such page."), { status: 404 });
  } catch (e) {
    if (e.status === 401) return;
    show(el("h1", {}, e.status === 404 ? "Not found" : "Something went wrong"), failure(e), el("p", {}, link("/", "Back to agents")));
  }
  if (!main().contains(document.activeElement) || document.activeElement === document.body) main().focus({ preventScroll: true });
}

function main() {
  return document.getElementById("main");
}

window.addEventListener("popstate", route);
document.addEventListener("DOMContentLoaded", route);
