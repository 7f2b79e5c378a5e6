// gateway console. Every piece of data reaches the page through textContent or an
// attribute set from code: nothing from the server is ever parsed as HTML.
"use strict";

(function () {
  const state = { session: null, inboxSource: null, runSource: null, timers: [], route: "" };

  // --- small helpers -------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else if (name === "className") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (name === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  const main = () => document.getElementById("main");
  const usd = (v) => (typeof v === "number" ? "$" + v.toFixed(6) : "–");
  const when = (ts) => (typeof ts === "number" ? new Date(ts * 1000).toLocaleString() : "–");

  function toast(text, isError) {
    const box = document.getElementById("toast");
    const item = el("div", { className: isError ? "error" : "", text });
    box.append(item);
    setTimeout(() => item.remove(), 6000);
  }

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error && body.error.message) || "HTTP " + status);
      this.status = status;
    }
  }

  async function call(path, options) {
    const opts = options || {};
    const headers = { "Accept": "application/json" };
    let body;
    if (opts.body !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(opts.body); }
    if (opts.method && opts.method !== "GET" && state.session) headers["X-CSRF-Token"] = state.session.csrf_token;
    const resp = await fetch(path, { method: opts.method || "GET", headers, body, credentials: "same-origin" });
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (!resp.ok) throw new ApiError(resp.status, data);
    return data;
  }

  function runPath(item, tail) {
    return "/console/api/runs/" + encodeURIComponent(item.id || item.run_id) + (tail || "") +
      "?team=" + encodeURIComponent(item.team);
  }
  const runHash = (team, id) => "#/run/" + encodeURIComponent(team) + "/" + encodeURIComponent(id);

  function pretty(args) {
    let value = args;
    if (typeof value === "string") { try { value = JSON.parse(value); } catch (e) { return value; } }
    return JSON.stringify(value, null, 2);
  }

  function left(expiresAt) {
    if (typeof expiresAt !== "number") return "never expires";
    const s = Math.floor(expiresAt - Date.now() / 1000);
    if (s <= 0) return "expired";
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
    if (d) return "expires in " + d + "d " + h + "h";
    if (h) return "expires in " + h + "h " + m + "m";
    if (m) return "expires in " + m + "m " + (s % 60) + "s";
    return "expires in " + s + "s";
  }

  function stopLive() {
    if (state.inboxSource) { state.inboxSource.close(); state.inboxSource = null; }
    if (state.runSource) { state.runSource.close(); state.runSource = null; }
    state.timers.forEach(clearInterval);
    state.timers = [];
  }

  // --- sign in -------------------------------------------------------------------------

  function showSignIn(message) {
    stopLive();
    state.session = null;
    document.getElementById("nav").hidden = true;
    document.getElementById("sign-out").hidden = true;
    document.getElementById("who").textContent = "";
    const key = el("input", { type: "password", id: "key", autocomplete: "off", placeholder: "sk-...", required: true });
    const error = el("p", { className: "error", id: "signin-error", text: message || "" });
    const form = el("form", { className: "card signin", id: "signin" },
      el("h1", { text: "Sign in" }),
      el("label", { for: "key", text: "Team key" }), key,
      el("button", { className: "primary", type: "submit", text: "Sign in" }), error,
      el("p", { className: "meta", text: "The key is kept for this browser session only." }));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      try {
        state.session = await call("/console/session", { method: "POST", body: { key: key.value } });
        key.value = "";
        signedIn();
      } catch (e) {
        error.textContent = e.message;
      }
    });
    clear(main()).append(form);
    key.focus();
  }

  function signedIn() {
    document.getElementById("nav").hidden = false;
    document.getElementById("sign-out").hidden = false;
    const s = state.session;
    document.getElementById("nav-keys").hidden = !(s.admin || s.manage_keys);
    document.getElementById("who").textContent = "team " + s.team + (s.admin ? " (admin)" : "") +
      (s.approver_of.length ? " · approver of " + s.approver_of.join(", ") : "");
    if (!location.hash || location.hash === "#") location.hash = "#/inbox";
    else route();
  }

  document.getElementById("sign-out").addEventListener("click", async () => {
    try { await call("/console/session", { method: "DELETE" }); } catch (e) { /* signed out anyway */ }
    location.hash = "";
    showSignIn("Signed out.");
  });

  // --- inbox ---------------------------------------------------------------------------

  const LIMIT_WORDS = { max_turns: "turns", max_budget_usd: "USD", max_tool_calls: "tool calls", max_duration_s: "seconds" };

  function limitCard(item) {
    // A limit request (on_exceed: ask): the limit, what was used, a grant the approver may change.
    const reason = el("input", { className: "reason", type: "text", maxlength: 2000, placeholder: "reason (recorded; the run's answer says it when rejecting)" });
    const approve = el("button", { className: "approve", type: "button", text: "Grant" });
    const reject = el("button", { className: "reject", type: "button", text: "Reject" });
    const expiry = el("span", { className: "expiry", text: left(item.expires_at) });
    const inputs = {};
    const grantRows = Object.entries(item.grant || {}).map(([name, amount]) => {
      const whole = name === "max_turns" || name === "max_tool_calls";
      const input = el("input", { type: "number", className: "grant", min: whole ? 1 : 0, step: whole ? 1 : "any",
        value: amount, dataset: { limit: name } });
      inputs[name] = input;
      const room = item.room && typeof item.room[name] === "number" ? " (at most " + item.room[name] + " more: max_total)" : "";
      return el("label", { className: "grant-row" }, "+ ", input, " " + (LIMIT_WORDS[name] || name) + " of " + name + room);
    });
    const used = item.limit === "max_budget_usd" ? usd(item.used) + " of " + usd(item.cap) + " spent"
      : item.used + " of " + item.cap + " " + (LIMIT_WORDS[item.limit] || "") + " used";
    const card = el("article", { className: "card pending limit", dataset: { key: item.key, limit: item.limit } },
      el("div", { className: "head" },
        el("span", { className: "tool", text: "limit " + item.limit }),
        el("a", { href: runHash(item.team, item.run_id), text: "run " + item.run_id }),
        el("span", { className: "meta", text: "team " + item.team + " · policy " + item.policy + " · model " +
          item.model + " · " + item.turns + " turns · " + usd(item.cost_usd) + " spent so far · " + item.grants + " grant(s) before" }),
        expiry),
      el("div", { className: "label", text: "reached" }),
      el("div", { className: "used", text: used }),
      el("div", { className: "label", text: "grant (edit to grant less or more)" }),
      el("div", { className: "grants" }, grantRows),
      el("div", { className: "label", text: "asked by" }),
      el("div", { className: "rule", text: item.rule }),
      item.last_user !== null ? el("div", { className: "label", text: "last user message" }) : null,
      item.last_user !== null ? el("div", { className: "msg user", text: item.last_user }) : null,
      el("div", { className: "label", text: "what the run was doing" }),
      el("div", { className: "msg assistant", text: item.assistant || "(nothing yet)" }),
      el("div", { className: "actions" }, approve, reason, reject),
      el("div", { className: "outcome" }));
    card._expiry = () => { expiry.textContent = left(item.expires_at); };
    wireDecision(item, approve, reject, reason, (body) => {
      if (body.decision !== "approve") return "Rejected more for run " + item.run_id;
      body.grant = {};
      for (const [name, input] of Object.entries(inputs)) if (input.value !== "") body.grant[name] = Number(input.value);
      return "Granted more to run " + item.run_id;
    });
    return card;
  }

  function wireDecision(item, approve, reject, reason, shape) {
    // The card's buttons post the decision (`shape` adds to the body and says what to toast).
    const decide = async (decision) => {
      approve.disabled = reject.disabled = true;
      const body = { call_id: item.call_id, decision, reason: reason.value };
      const done = shape(body);
      try {
        await call(runPath(item, "/approvals"), { method: "POST", body });
        toast(done);
      } catch (e) {
        approve.disabled = reject.disabled = false;
        toast(e.message, true);
      }
    };
    approve.addEventListener("click", () => decide("approve"));
    reject.addEventListener("click", () => decide("reject"));
  }

  function inboxCard(item) {
    if (item.kind === "limit") return limitCard(item);
    const reason = el("input", { className: "reason", type: "text", maxlength: 2000, placeholder: "reason (sent to the model when rejecting)" });
    const approve = el("button", { className: "approve", type: "button", text: "Approve" });
    const reject = el("button", { className: "reject", type: "button", text: "Reject" });
    const expiry = el("span", { className: "expiry", text: left(item.expires_at) });
    const card = el("article", { className: "card pending", dataset: { key: item.key, tool: item.tool } },
      el("div", { className: "head" },
        el("span", { className: "tool", text: item.tool }),
        el("a", { href: runHash(item.team, item.run_id), text: "run " + item.run_id }),
        el("span", { className: "meta", text: "team " + item.team + " · policy " + item.policy + " · model " +
          item.model + " · " + item.turns + " turns · " + usd(item.cost_usd) }),
        expiry),
      el("div", { className: "label", text: "arguments" }),
      el("pre", { className: "args", text: pretty(item.args) }),
      el("div", { className: "label", text: "asked by" }),
      el("div", { className: "rule", text: item.rule }),
      item.last_user !== null ? el("div", { className: "label", text: "last user message" }) : null,
      item.last_user !== null ? el("div", { className: "msg user", text: item.last_user }) : null,
      el("div", { className: "label", text: "assistant message that made the call" }),
      el("div", { className: "msg assistant", text: item.assistant || "(no text, only the call)" }),
      el("div", { className: "actions" }, approve, reason, reject),
      el("div", { className: "outcome" }));
    card._expiry = () => { expiry.textContent = left(item.expires_at); };
    wireDecision(item, approve, reject, reason, (body) =>
      (body.decision === "approve" ? "Approved " : "Rejected ") + item.tool + " of run " + item.run_id);
    return card;
  }

  function markDecided(card, info) {
    card.classList.remove("pending");
    card.classList.add("decided");
    card.querySelectorAll("button, input").forEach((n) => { n.disabled = true; });
    const outcome = card.querySelector(".outcome");
    clear(outcome);
    if (info.decision) {
      const granted = card.classList.contains("limit");
      const verb = info.decision === "approve" ? (granted ? "granted" : "approved") : "rejected";
      // a DOM append() writes null as the text "null": a decision without a reason adds nothing
      outcome.append(el("span", { className: "verdict " + info.decision, text: verb + " by " + info.by }));
      if (info.reason) outcome.append(el("span", { className: "meta", text: " — " + info.reason }));
    } else {
      outcome.append(el("span", { className: "verdict", text: "no longer waiting (run " + info.status + ")" }));
    }
    document.getElementById("decided-list").prepend(card);
  }

  function updateCount() {
    const n = document.querySelectorAll("#pending-list .card.pending").length;
    document.getElementById("inbox-count").textContent = n ? String(n) : "";
    const empty = document.getElementById("pending-empty");
    if (empty) empty.hidden = n > 0;
  }

  function showInbox() {
    const pending = el("div", { id: "pending-list" });
    const decided = el("div", { id: "decided-list" });
    clear(main()).append(
      el("h1", { text: "Inbox" }),
      el("p", { className: "meta", id: "inbox-live", text: "Connecting…" }),
      el("p", { className: "empty", id: "pending-empty", text: "Nothing waits for your decision." }),
      pending, el("h2", { text: "Decided while this page was open" }), decided);
    const cards = new Map();
    const add = (item) => {
      if (cards.has(item.key)) return;
      const card = inboxCard(item);
      cards.set(item.key, card);
      pending.append(card); // the server sends them oldest first
    };
    const source = new EventSource("/console/api/inbox/events");
    state.inboxSource = source;
    source.addEventListener("error", () => {
      const live = document.getElementById("inbox-live");
      if (live) live.textContent = "Reconnecting…";
      checkSession();
    });
    source.addEventListener("snapshot", (event) => {
      const items = JSON.parse(event.data).data;
      const keys = new Set(items.map((i) => i.key));
      for (const [key, card] of cards) if (!keys.has(key) && card.classList.contains("pending")) card.remove();
      items.forEach(add);
      updateCount();
      document.getElementById("inbox-live").textContent = "Live: updates as approvals arrive and are decided.";
    });
    source.addEventListener("added", (event) => { add(JSON.parse(event.data)); updateCount(); });
    source.addEventListener("decided", (event) => {
      const info = JSON.parse(event.data);
      const card = cards.get(info.key);
      if (card) markDecided(card, info);
      updateCount();
    });
    state.timers.push(setInterval(() => cards.forEach((c) => c._expiry && c._expiry()), 1000));
  }

  async function checkSession() {
    try { await call("/console/session"); } catch (e) { if (e.status === 401) showSignIn("Your session ended: sign in again."); }
  }

  // --- runs ----------------------------------------------------------------------------

  const STATUSES = ["", "running", "completed", "interrupted", "failed", "max_turns_exceeded", "budget_exceeded"];

  async function showRuns(params) {
    const status = el("select", { id: "f-status" }, STATUSES.map((s) => el("option", { value: s, text: s || "any status" })));
    status.value = params.get("status") || "";
    const team = el("input", { id: "f-team", placeholder: "team", value: params.get("team") || "" });
    const policy = el("input", { id: "f-policy", placeholder: "policy", value: params.get("policy") || "" });
    const apply = el("button", { type: "submit", className: "primary", text: "Filter" });
    const form = el("form", { className: "filters" }, status, team, policy, apply);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const q = new URLSearchParams();
      if (status.value) q.set("status", status.value);
      if (team.value.trim()) q.set("team", team.value.trim());
      if (policy.value.trim()) q.set("policy", policy.value.trim());
      location.hash = "#/runs" + (q.toString() ? "?" + q.toString() : "");
    });
    const body = el("tbody");
    clear(main()).append(el("h1", { text: "Runs" }), form,
      el("table", { id: "runs" }, el("thead", {}, el("tr", {},
        ["run", "team", "policy", "model", "status", "turns", "cost", "updated"].map((h) =>
          el("th", { className: h === "turns" || h === "cost" ? "num" : "", text: h })))), body));
    try {
      const data = await call("/console/api/runs?" + params.toString());
      if (!data.data.length) body.append(el("tr", {}, el("td", { colspan: 8, className: "empty", text: "No runs match." })));
      for (const run of data.data) {
        body.append(el("tr", {},
          el("td", {}, el("a", { href: runHash(run.team, run.id), text: run.id })),
          el("td", { text: run.team }), el("td", { text: run.policy }), el("td", { text: run.model }),
          el("td", {}, el("span", { className: "status " + run.status, text: run.status }),
            run.reason ? el("span", { className: "meta", text: " (" + run.reason + ")" }) : null),
          el("td", { className: "num", text: run.turns }), el("td", { className: "num", text: usd(run.cost_usd) }),
          el("td", { text: when(run.updated_at) })));
      }
    } catch (e) {
      body.append(el("tr", {}, el("td", { colspan: 8, className: "error", text: e.message })));
    }
  }

  function messageNode(m) {
    const role = String(m.role || "?");
    const parts = [el("span", { className: "role", text: role + (m.name ? " " + m.name : "") })];
    let content = m.content;
    if (Array.isArray(content)) content = content.map((p) => (p && p.text) || "").join("");
    if (content !== null && content !== undefined && content !== "") parts.push(el("span", { className: "content", text: String(content) }));
    for (const c of (Array.isArray(m.tool_calls) ? m.tool_calls : [])) {
      const fn = (c && c.function) || {};
      parts.push(el("pre", { className: "call", text: "→ " + fn.name + " (" + c.id + ")\n" + pretty(fn.arguments) }));
    }
    return el("div", { className: "msg " + role, dataset: { callId: m.tool_call_id || "" } }, parts);
  }

  async function showRun(team, id) {
    const ref = { id, team };
    let run, trace;
    try {
      [run, trace] = await Promise.all([call(runPath(ref)), call(runPath(ref, "/trace"))]);
    } catch (e) {
      clear(main()).append(el("h1", { text: "Run " + id }), el("p", { className: "error", text: e.message }));
      return;
    }
    if (state.route !== "run:" + team + "/" + id) return; // the user moved on meanwhile
    const facts = [["status", run.status], ["stop reason", run.reason || "–"], ["team", run.team],
      ["policy", run.policy + (run.policy_version ? " @" + run.policy_version : "")], ["model", run.model],
      ["turns", run.turns + (run.limits.max_turns ? " / " + run.limits.max_turns : "")],
      ["cost", usd(run.cost_usd) + (run.limits.max_budget_usd ? " / " + usd(run.limits.max_budget_usd) : "")],
      ["updated", when(run.updated_at)]];
    const grid = el("div", { className: "grid card", id: "run-facts" },
      facts.map(([k, v]) => el("div", { dataset: { fact: k } }, el("span", { text: k }), el("b", { text: v }))));
    const error = run.error ? el("p", { className: "error", text: run.error }) : null;
    const asked = run.interruption && (run.interruption.type === "approval" || run.interruption.type === "limit")
      ? run.interruption : null;
    const what = asked ? el("code", { text: asked.type === "limit" ? "more " + asked.limit : asked.tool_name }) : null;
    let waiting = null;
    if (asked && asked.waiting_for === "decision") {
      waiting = el("p", { id: "waiting" }, "Waits for a decision on ", what,
        " — see the ", el("a", { href: "#/inbox", text: "inbox" }), ".");
    } else if (asked) {
      const verdict = asked.decision === "approve" ? (asked.type === "limit" ? "Granted: " : "Approved: ") : "Rejected: ";
      waiting = el("p", { id: "waiting" }, verdict, what, "; waits to be resumed by its team.");
    }

    const actions = el("div", { className: "actions card" });
    const cancel = el("button", { type: "button", id: "cancel", text: "Cancel run" });
    cancel.disabled = !(run.status === "running" || asked);
    cancel.addEventListener("click", async () => {
      cancel.disabled = true;
      try { await call(runPath(ref, "/cancel"), { method: "POST", body: { reason: "cancelled from the console" } }); toast("Cancelled run " + id); }
      catch (e) { toast(e.message, true); }
      route();
    });
    const maxTurns = el("input", { type: "number", min: 1, id: "r-turns", placeholder: "max turns (" + (run.limits.max_turns || "none") + ")" });
    const maxBudget = el("input", { type: "number", min: 0, step: "0.01", id: "r-budget", placeholder: "max budget $ (" + (run.limits.max_budget_usd || "none") + ")" });
    const maxCalls = el("input", { type: "number", min: 1, id: "r-calls", placeholder: "max tool calls (" + (run.limits.max_tool_calls || "none") + ")" });
    const resume = el("button", { type: "button", className: "primary", id: "resume", text: "Resume with these limits" });
    resume.addEventListener("click", async () => {
      const body = {};
      if (maxTurns.value) body.max_turns = Number(maxTurns.value);
      if (maxBudget.value) body.max_budget_usd = Number(maxBudget.value);
      if (maxCalls.value) body.max_tool_calls = Number(maxCalls.value);
      resume.disabled = true;
      try { await call(runPath(ref, "/resume"), { method: "POST", body }); toast("Resumed run " + id); }
      catch (e) { toast(e.message, true); }
      route();
    });
    actions.append(cancel, maxTurns, maxBudget, maxCalls, resume);
    const maySteer = run.team === state.session.team || state.session.admin; // the server checks it again
    const steer = maySteer ? actions : el("p", { className: "meta", id: "no-steer",
      text: "Cancelling and resuming belong to team " + run.team + " and to admin teams." });

    const turns = el("tbody");
    for (const t of trace.turns) {
      turns.append(el("tr", {}, el("td", { text: t.turn }), el("td", { className: "num", text: t.prompt_tokens }),
        el("td", { className: "num", text: t.completion_tokens }), el("td", { className: "num", text: usd(t.cost_usd) }),
        el("td", { className: "num", text: usd(t.total_usd) })));
    }
    clear(main()).append(...[
      el("h1", {}, "Run ", el("code", { text: id }), " ", el("span", { className: "status " + run.status, text: run.status })),
      grid, error, waiting, steer,
      el("h2", { text: "Transcript" }),
      el("div", { className: "transcript", id: "transcript" }, (run.transcript || []).map(messageNode)),
      el("h2", { text: "Cost per turn" }),
      el("table", { id: "turns" }, el("thead", {}, el("tr", {},
        ["turn", "tokens in", "tokens out", "cost", "run total"].map((h, i) => el("th", { className: i ? "num" : "", text: h })))), turns),
      el("h2", { text: "Trace" }),
      el("pre", { id: "timeline", text: trace.lines.join("\n") })].filter(Boolean));
    followRun(ref, run, trace.last_seq);
  }

  function followRun(ref, run, after) {
    if (state.runSource) { state.runSource.close(); state.runSource = null; }
    const live = run.status === "running" || (run.interruption && (run.interruption.type === "approval" || run.interruption.type === "limit"));
    if (!live) return;
    const source = new EventSource(runPath(ref, "/events") + "&follow=1&after=" + after);
    state.runSource = source;
    let pending = null;
    const refresh = () => {
      if (pending) return;
      pending = setTimeout(() => { pending = null; if (state.route === "run:" + ref.team + "/" + ref.id) showRun(ref.team, ref.id); }, 300);
    };
    let seen = 0; // a run that waits for a person under a policy that does not resume ends at once: no refresh loop
    source.addEventListener("message", () => { seen += 1; refresh(); });
    source.addEventListener("end", () => { source.close(); if (seen) refresh(); });
    source.addEventListener("error", () => { source.close(); });
  }

  // --- spend ---------------------------------------------------------------------------

  const GROUPS = { key: "key", user: "user", model: "model", team: "team", policy: "policy", day: "day" };

  async function showSpendReport(groupBy) {
    const box = document.getElementById("spend-report");
    if (!box) return;
    const body = el("tbody");
    const heads = groupBy === "key" ? ["key", "name", "calls", "cost"] : [groupBy, "calls", "cost"];
    clear(box).append(el("table", { id: "spend-by" }, el("thead", {}, el("tr", {},
      heads.map((h) => el("th", { className: h === "calls" || h === "cost" ? "num" : "", text: h })))), body));
    try {
      const data = await call("/console/api/spend/report?group_by=" + encodeURIComponent(groupBy));
      for (const row of data.data) {
        const cells = [el("td", { text: row[groupBy] || "–" })];
        if (groupBy === "key") cells.push(el("td", { text: row.key_name || "" }));
        cells.push(el("td", { className: "num", text: row.calls }), el("td", { className: "num", text: usd(row.cost_usd) }));
        body.append(el("tr", { dataset: { group: row[groupBy] || "" } }, cells));
      }
      body.append(el("tr", { className: "total" }, el("td", { text: "total, " + data.from + " to " + data.to }),
        groupBy === "key" ? el("td", {}) : null, el("td", { className: "num", text: data.calls }),
        el("td", { className: "num", text: usd(data.total_usd) })));
    } catch (e) {
      body.append(el("tr", {}, el("td", { colspan: heads.length, className: "error", text: e.message })));
    }
  }

  async function showSpend(params) {
    const body = el("tbody");
    const groupBy = GROUPS[params.get("by") || "key"] || "key";
    const tabs = el("div", { className: "filters", id: "spend-tabs" }, ["key", "user", "model"].map((g) =>
      el("a", { href: "#/spend?by=" + g, className: g === groupBy ? "tab active" : "tab", text: "by " + g })));
    clear(main()).append(el("h1", { text: "Spend" }),
      el("table", { id: "spend" }, el("thead", {}, el("tr", {},
        ["team", "period", "spent", "reserved", "budget", "remaining", ""].map((h) => el("th", { text: h })))), body),
      el("h2", { text: "The last 30 days" }), tabs, el("div", { id: "spend-report" }));
    showSpendReport(groupBy);
    try {
      const data = await call("/console/api/spend");
      for (const row of data.data) {
        const meter = row.budget_usd ? el("meter", { min: 0, max: row.budget_usd, low: row.budget_usd * 0.8,
          high: row.budget_usd * 0.95, optimum: 0, value: Math.min(row.spent_usd + row.reserved_usd, row.budget_usd) }) : "no budget";
        body.append(el("tr", { dataset: { team: row.team } }, el("td", { text: row.team }),
          el("td", { text: row.budget_period + " " + row.period }),
          el("td", { className: "num", text: usd(row.spent_usd) }), el("td", { className: "num", text: usd(row.reserved_usd) }),
          el("td", { className: "num", text: row.budget_usd === null ? "none" : usd(row.budget_usd) }),
          el("td", { className: "num", text: row.remaining_usd === null ? "–" : usd(row.remaining_usd) }),
          el("td", {}, meter)));
      }
    } catch (e) {
      body.append(el("tr", {}, el("td", { colspan: 7, className: "error", text: e.message })));
    }
  }

  // --- keys ----------------------------------------------------------------------------

  function keyState(k) {
    if (k.revoked_at) return "revoked";
    if (typeof k.expires_at === "number" && k.expires_at <= Date.now() / 1000) return "expired";
    return "active";
  }

  function showSecret(title, made) {
    // The secret is in this answer only: shown once, never stored by the page.
    const box = document.getElementById("secret-box");
    const done = el("button", { type: "button", id: "secret-done", text: "I have stored it" });
    clear(box).append(el("div", { className: "card secret" },
      el("h2", { text: title }),
      el("p", { text: "Key " + made.id + " (" + made.name + "). This secret is shown once: store it now. " +
        "The gateway keeps only its hash." }),
      el("pre", { id: "secret-once", text: made.key }),
      (made.warnings || []).map((w) => el("p", { className: "meta warning", text: w })), done));
    done.addEventListener("click", () => clear(box));
  }

  async function showKeys() {
    const s = state.session;
    const body = el("tbody");
    const team = el("input", { id: "k-team", value: s.team, placeholder: "team", required: true });
    if (!s.admin) team.readOnly = true;
    const name = el("input", { id: "k-name", placeholder: "name (what it is for)", maxlength: 100, required: true });
    const user = el("input", { id: "k-user", placeholder: "user (optional)" });
    const models = el("input", { id: "k-models", placeholder: "models, comma-separated globs (optional)" });
    const budget = el("input", { id: "k-budget", type: "number", min: 0, step: "0.01", placeholder: "budget $ (optional)" });
    const period = el("select", { id: "k-period" }, ["month", "week", "day", "total"].map((p) => el("option", { value: p, text: "per " + p })));
    const days = el("input", { id: "k-days", type: "number", min: 1, placeholder: "expires in days (optional)" });
    const create = el("button", { type: "submit", className: "primary", id: "k-create", text: "Create key" });
    const form = el("form", { className: "filters card", id: "key-form" }, team, name, user, models, budget, period, days, create);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const payload = { team: team.value.trim(), name: name.value.trim() };
      if (user.value.trim()) payload.user = user.value.trim();
      if (models.value.trim()) payload.models = models.value.split(",").map((m) => m.trim()).filter(Boolean);
      if (budget.value) { payload.budget_usd = Number(budget.value); payload.budget_period = period.value; }
      if (days.value) payload.expires_in_s = Number(days.value) * 86400;
      create.disabled = true;
      try {
        const made = await call("/console/api/keys", { method: "POST", body: payload });
        name.value = "";
        showSecret("New key", made);
        await listKeys(body);
      } catch (e) { toast(e.message, true); }
      create.disabled = false;
    });
    const all = el("input", { type: "checkbox", id: "k-all" });
    all.addEventListener("change", () => listKeys(body));
    clear(main()).append(el("h1", { text: "Keys" }), el("div", { id: "secret-box" }), form,
      el("label", { className: "meta" }, all, " show revoked and expired keys"),
      el("table", { id: "keys" }, el("thead", {}, el("tr", {},
        ["id", "team", "name", "prefix", "user", "budget", "state", "last used", ""].map((h) => el("th", { text: h })))), body));
    await listKeys(body);
  }

  async function listKeys(body) {
    const all = document.getElementById("k-all");
    clear(body);
    try {
      const data = await call("/console/api/keys?limit=200" + (all && all.checked ? "&include_revoked=true" : ""));
      if (!data.data.length) body.append(el("tr", {}, el("td", { colspan: 9, className: "empty", text: "No keys." })));
      for (const k of data.data) {
        const actions = el("td", { className: "actions" });
        if (k.source === "store" && !k.revoked_at) {
          const grace = el("input", { type: "number", min: 0, max: 604800, className: "grace", placeholder: "grace s", value: "0" });
          const rotate = el("button", { type: "button", className: "rotate", text: "Rotate" });
          const revoke = el("button", { type: "button", className: "reject revoke", text: "Revoke" });
          rotate.addEventListener("click", async () => {
            rotate.disabled = true;
            try {
              const made = await call("/console/api/keys/" + encodeURIComponent(k.id) + "/rotate",
                { method: "POST", body: { grace_s: Number(grace.value || 0) } });
              showSecret("Rotated key", made);
              await listKeys(body);
            } catch (e) { toast(e.message, true); rotate.disabled = false; }
          });
          revoke.addEventListener("click", async () => {
            revoke.disabled = true;
            try {
              await call("/console/api/keys/" + encodeURIComponent(k.id), { method: "DELETE" });
              toast("Revoked key " + k.id);
              await listKeys(body);
            } catch (e) { toast(e.message, true); revoke.disabled = false; }
          });
          actions.append(grace, rotate, revoke);
        } else if (k.source === "config") {
          actions.append(el("span", { className: "meta", text: "config.yaml" }));
        }
        body.append(el("tr", { dataset: { key: k.id } },
          el("td", {}, el("code", { text: k.id })), el("td", { text: k.team }), el("td", { text: k.name }),
          el("td", { text: k.prefix || "–" }), el("td", { text: k.user || "–" }),
          el("td", { text: k.budget_usd === null ? "–" : usd(k.budget_usd) + " / " + k.budget_period }),
          el("td", {}, el("span", { className: "status key-" + keyState(k), text: keyState(k) })),
          el("td", { text: when(k.last_used_at) }), actions));
      }
    } catch (e) {
      body.append(el("tr", {}, el("td", { colspan: 9, className: "error", text: e.message })));
    }
  }

  // --- routing -------------------------------------------------------------------------

  function route() {
    if (!state.session) return;
    stopLive();
    const hash = location.hash.replace(/^#/, "") || "/inbox";
    const [path, query] = hash.split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.id === "nav-" + parts[0]));
    if (parts[0] === "runs") { state.route = "runs"; showRuns(new URLSearchParams(query || "")); }
    else if (parts[0] === "run" && parts.length === 3) { state.route = "run:" + parts[1] + "/" + parts[2]; showRun(parts[1], parts[2]); }
    else if (parts[0] === "spend") { state.route = "spend"; showSpend(new URLSearchParams(query || "")); }
    else if (parts[0] === "keys") { state.route = "keys"; showKeys(); }
    else { state.route = "inbox"; showInbox(); }
  }

  window.addEventListener("hashchange", route);

  (async function start() {
    try {
      state.session = await call("/console/session");
      signedIn();
    } catch (e) {
      showSignIn(e.status === 401 ? "" : e.message);
    }
  })();
})();
