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
async function follow(path, after, onEvent, onState, signal) {
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

// `rejected` is the token a request was refused with: a token stored since (a sign-in in
// another tab) is not the one refused, and stays.
function signedOut(rejected = token) {
  if (localStorage.getItem(TOKEN_KEY) === rejected) localStorage.removeItem(TOKEN_KEY);
  token = "";
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
// Routing
// ---------------------------------------------------------------------------------------

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
  const path = location.pathname;
  let m;
  try {
    if ((m = path.match(/^\/agents\/([A-Za-z0-9_]+)$/))) await agentPage(m[1], signal);
    else if ((m = path.match(/^\/workspaces\/([A-Za-z0-9_]+)$/))) await workspacePage(m[1], signal);
    else if (path === "/device") await devicePage(me);
    else await homePage(signal);
  } catch (e) {
    if (e.status === 401) return;
    show(el("h1", {}, e.status === 404 ? "Not found" : "Something went wrong"), failure(e), el("p", {}, link("/", "Back to agents")));
  }
  document.getElementById("main").focus({ preventScroll: true });
}

window.addEventListener("popstate", route);
document.addEventListener("DOMContentLoaded", route);
