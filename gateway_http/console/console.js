// The operator console: the gateway's own JSON-RPC methods (POST /api/rpc) and, when it is
// there, GET /metrics. Two pages: memory (#memory, the default) and usage (#usage: a daily
// chart per model and tables, from usage.summary). No dependencies, no build step. The JWT lives in this tab's
// sessionStorage and travels only in the Authorization header: never in a URL, never logged.
// Everything the server sends is shown through textContent, never parsed as HTML.
// Times arrive as UTC ISO strings; they are shown in the browser's time zone, with the UTC
// string as each time's title (on hover).
"use strict";

(function () {
  const TOKEN_KEY = "arona.console.jwt";
  const REFRESH_MS = 2000;
  // Turns per minute are measured over the scrapes of the last minute.
  const RATE_WINDOW_MS = 60000;
  const MEMORY_STATES = ["enabled", "disabled", "offline"];

  // One colour per model on the usage chart, in order of their tokens.
  const COLOURS = ["#1a5fb4", "#c64600", "#26a269", "#9141ac", "#a51d2d", "#986a44", "#0a7d8c", "#5e5c64"];
  const SVG = "http://www.w3.org/2000/svg";
  const MAX_CHART_DAYS = 366;
  const count = new Intl.NumberFormat("en-US");

  const AUTH_REQUIRED = -32005;
  const NOT_ALLOWED = -32007;

  const $ = (id) => document.getElementById(id);

  let token = null;
  let timer = null;
  let generation = 0;
  let samples = [];
  let metricsWithToken = false;
  // What the episodes panel last listed, {scope, anonymous, contains} (scope null: the
  // caller's own): what "Older episodes" pages through and "Forget all" forgets.
  let listing = null;
  let episodesNext = null;
  // "shared" or "user", from the last status (null until one came).
  let scopeMode = null;

  class RpcError extends Error {
    constructor(code, message, data) {
      super(message);
      this.code = code;
      this.data = data;
    }
  }

  async function rpc(method, params) {
    let response;
    try {
      response = await fetch("/api/rpc", {
        method: "POST",
        headers: {
          "Content-Type": "application/json",
          Authorization: "Bearer " + token,
        },
        body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: method, params: params || {} }),
        cache: "no-store",
        credentials: "omit",
      });
    } catch (err) {
      throw new RpcError(null, "the gateway does not answer");
    }
    let reply;
    try {
      reply = await response.json();
    } catch (err) {
      throw new RpcError(null, "the gateway answered HTTP " + response.status);
    }
    if (reply && reply.error) {
      throw new RpcError(reply.error.code, reply.error.message || "error", reply.error.data);
    }
    if (!reply || !("result" in reply)) {
      throw new RpcError(null, "the gateway answered HTTP " + response.status);
    }
    return reply.result;
  }

  function authProblem(err) {
    if (err.code === AUTH_REQUIRED) return "Token refused (invalid, expired or not for this gateway).";
    if (err.code === NOT_ALLOWED) return "This token is not an admin's.";
    return null;
  }

  function describe(err) {
    return authProblem(err) || (err.message ? err.message : String(err));
  }

  // ---- the JWT's claims, for display only (the server verifies it) ----
  function claims(jwt) {
    try {
      const part = jwt.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
      const padded = part + "===".slice((part.length + 3) % 4);
      return JSON.parse(atob(padded));
    } catch (err) {
      return {};
    }
  }

  // ---- times: local on the page, UTC on hover ----
  const pad = (n) => String(n).padStart(2, "0");

  // "2026-12-02 09:36:56" in the browser's time zone, or null for what is not a time.
  function localTime(iso) {
    const d = typeof iso === "string" ? new Date(iso) : null;
    if (d === null || Number.isNaN(d.getTime())) return null;
    const day = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate());
    return day + " " + pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  // A <time> showing the local time, its title the UTC string as sent; anything else as text.
  function timeNode(iso) {
    const local = localTime(iso);
    if (local === null) return document.createTextNode(iso === null || iso === undefined ? "" : String(iso));
    const node = document.createElement("time");
    node.dateTime = iso;
    node.title = iso;
    node.textContent = local;
    return node;
  }

  // "Europe/Paris, UTC+01:00": said once per panel so that a local time is never ambiguous.
  function timeZoneName() {
    const offset = -new Date().getTimezoneOffset();
    const sign = offset < 0 ? "-" : "+";
    const utc = "UTC" + sign + pad(Math.floor(Math.abs(offset) / 60)) + ":" + pad(Math.abs(offset) % 60);
    const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
    return zone ? zone + ", " + utc : utc;
  }

  // ---- sign in / out ----
  async function signIn(candidate, fromStorage) {
    const error = $("sign-in-error");
    error.textContent = "";
    if (!candidate) {
      error.textContent = "Paste a JWT first.";
      $("token").focus();
      return;
    }
    token = candidate;
    let status = null;
    let problem = null;
    try {
      status = await rpc("memory.status", { limit: 50 });
    } catch (err) {
      if (authProblem(err) !== null || err.code === null || err.code === undefined) {
        // A refused token (or no JSON-RPC answer at all): stay signed out and say why.
        token = null;
        sessionStorage.removeItem(TOKEN_KEY);
        error.textContent = (fromStorage ? "Signed out: " : "") + describe(err);
        $("token").focus();
        return;
      }
      // The token was accepted, the memory service did not answer: an outage is exactly
      // when the console is needed, so sign in and keep refreshing.
      problem = err;
    }
    sessionStorage.setItem(TOKEN_KEY, candidate);
    $("token").value = "";
    showConsole(true);
    if (status !== null) renderStatus(status);
    else $("status-error").textContent = "Status not refreshed: " + describe(problem);
    start();
    showPage(true);
  }

  function signOut(message) {
    stop();
    token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    showConsole(false);
    $("sign-in-error").textContent = message || "";
    $("token").focus();
  }

  function showConsole(on) {
    $("sign-in").hidden = on;
    $("console").hidden = !on;
    $("sign-out").hidden = !on;
    const who = $("who");
    who.hidden = !on;
    if (on) {
      const c = claims(token);
      let text = "Signed in as " + (c.sub || "?");
      if (c.role === "admin") text += " (admin)";
      who.textContent = text;
      if (typeof c.exp === "number") {
        who.append(", token valid until ", timeNode(new Date(c.exp * 1000).toISOString()));
      }
      $("usage-principal").value = "";
      showUsageScope(null);
      scopeMode = null;
      resetEpisodes();
      showMemoryChoices();
    } else {
      who.textContent = "";
    }
  }

  // ---- live refresh ----
  function start() {
    stop();
    samples = [];
    metricsWithToken = false;
    const mine = ++generation;
    const tick = async () => {
      await refresh();
      if (mine === generation && token) timer = setTimeout(tick, REFRESH_MS);
    };
    timer = setTimeout(tick, 0);
  }

  function stop() {
    generation++;
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  async function refresh() {
    const mine = generation;
    try {
      const status = await rpc("memory.status", { limit: 50 });
      if (mine !== generation) return;
      renderStatus(status);
      $("status-error").textContent = "";
    } catch (err) {
      if (mine !== generation) return;
      if (err.code === AUTH_REQUIRED || err.code === NOT_ALLOWED) {
        signOut(describe(err));
        return;
      }
      $("status-error").textContent = "Status not refreshed: " + describe(err);
    }
    await scrapeMetrics(mine);
  }

  function text(id, value) {
    $(id).textContent = value === null || value === undefined || value === "" ? "—" : String(value);
  }

  function time(id, iso) {
    if (iso === null || iso === undefined || iso === "") text(id, iso);
    else $(id).replaceChildren(timeNode(iso));
  }

  function onOff(value) {
    return value ? "on" : "off";
  }

  // "10.0.0.5:50051 (2/2 streams), 10.0.0.6:50051 (0/2 streams)"; the replica this status
  // came from is marked, since the breaker, outbox and events above are its own.
  function describeReplicas(replicas, answeredBy) {
    if (!Array.isArray(replicas) || replicas.length === 0) return null;
    return replicas
      .map((r) => {
        const streams = r.streams ? " (" + r.streams_open + "/" + r.streams + " streams)" : " (unary calls)";
        return r.address + streams + (r.address === answeredBy && replicas.length > 1 ? " — answered this status" : "");
      })
      .join(", ");
  }

  function renderStatus(s) {
    text("enabled", onOff(s.enabled));
    text("writeback", onOff(s.writeback));
    text("scope-mode", s.scope);
    scopeMode = s.scope;
    showMemoryChoices();
    const breaker = $("breaker");
    breaker.textContent = s.breaker || "—";
    breaker.className = "badge breaker-" + (s.breaker || "unknown");
    time("breaker-opened-at", s.breaker_opened_at);
    // null while the outbox cannot be written: what it could not keep is lost, not counted.
    text("outbox-depth", s.outbox_depth === null ? "unknown (cannot be written)" : s.outbox_depth);
    text("outbox-dropped", s.outbox_dropped);
    text("outbox-dead-letters", s.dead_letters);
    renderStorage(s.storage_faults || []);
    renderStores(s.stores || []);
    text("replicas", describeReplicas(s.replicas, s.answered_by));
    time("refreshed", new Date().toISOString());
    renderEvents(s.events || []);
  }

  // Each store ARONA_MEMORY_URL names, when it names several: "ws://10.0.0.7:8424/ws up since
  // 14:02:11", or, marked, "… down since 14:03:00: cannot connect …"; "—" for one store (the
  // breaker above is its state).
  function renderStores(stores) {
    if (!stores.length) {
      text("stores", null);
      return;
    }
    const parts = document.createDocumentFragment();
    stores.forEach((st, i) => {
      if (i) parts.appendChild(document.createElement("br"));
      const line = document.createElement("span");
      if (st.state !== "up") line.className = "storage-bad";
      line.appendChild(document.createTextNode(st.url + " " + st.state + " since "));
      line.appendChild(timeNode(st.since));
      if (st.error) line.appendChild(document.createTextNode(": " + st.error));
      parts.appendChild(line);
    });
    $("stores").replaceChildren(parts);
  }

  // "all writable", or each file that cannot be written: "outbox (outbox.db): database or disk
  // is full, since 14:02:11, 50 failed writes".
  function renderStorage(faults) {
    const dd = $("storage");
    dd.className = faults.length ? "storage-bad" : "";
    if (!faults.length) {
      dd.textContent = "all writable";
      return;
    }
    const parts = document.createDocumentFragment();
    faults.forEach((f, i) => {
      if (i) parts.appendChild(document.createElement("br"));
      parts.appendChild(document.createTextNode(f.part + " (" + f.file + "): " + f.reason + ", since "));
      parts.appendChild(timeNode(f.since));
      parts.appendChild(document.createTextNode(", " + f.failed_writes + " failed writes"));
    });
    dd.replaceChildren(parts);
  }

  // A cell; its label heads it where a narrow screen shows each row as a block.
  function cell(row, value, className, label) {
    const td = document.createElement("td");
    td.textContent = value === null || value === undefined ? "" : String(value);
    if (className) td.className = className;
    if (label) td.dataset.label = label;
    row.appendChild(td);
    return td;
  }

  function timeCell(row, iso, label) {
    const td = cell(row, null, "nowrap", label);
    td.appendChild(timeNode(iso));
    return td;
  }

  function renderEvents(events) {
    const body = $("events-table").tBodies[0];
    const rows = document.createDocumentFragment();
    for (const e of events) {
      const row = document.createElement("tr");
      row.className = "event-" + e.kind;
      timeCell(row, e.at, "At");
      cell(row, e.kind, null, "Kind");
      cell(row, e.detail, "detail", "Detail");
      cell(row, e.scope_id, "mono", "Scope id");
      rows.appendChild(row);
    }
    if (!events.length) {
      const row = document.createElement("tr");
      cell(row, "No events yet.").colSpan = 4;
      rows.appendChild(row);
    }
    body.replaceChildren(rows);
  }

  // ---- turns per minute, from arona_turns_total{surface,memory,outcome} ----
  function unescapeLabel(value) {
    return value.replace(/\\(.)/g, (m, c) => (c === "n" ? "\n" : c));
  }

  function turnsByMemory(exposition) {
    const totals = {};
    let seen = false;
    const line = /^arona_turns_total\{([^}]*)\}\s+(\S+)/;
    const label = /(\w+)="((?:[^"\\]|\\.)*)"/g;
    for (const raw of exposition.split("\n")) {
      const m = line.exec(raw.trim());
      if (!m) continue;
      const value = Number(m[2]);
      if (!Number.isFinite(value)) continue;
      let memory = null;
      for (const l of m[1].matchAll(label)) {
        if (l[1] === "memory") memory = unescapeLabel(l[2]);
      }
      if (memory === null) continue;
      seen = true;
      totals[memory] = (totals[memory] || 0) + value;
    }
    return seen ? totals : null;
  }

  function metricsNote(message) {
    $("metrics-note").textContent = message;
  }

  function clearTurns() {
    for (const state of MEMORY_STATES) {
      text("tpm-" + state, "–");
      text("total-" + state, "–");
    }
  }

  async function fetchMetrics() {
    const get = (withToken) =>
      fetch("/metrics", {
        headers: withToken ? { Authorization: "Bearer " + token } : {},
        cache: "no-store",
        credentials: "omit",
      });
    let response = await get(metricsWithToken);
    if (!metricsWithToken && (response.status === 401 || response.status === 403)) {
      // A /metrics that wants a bearer: the console's own token, same origin.
      response = await get(true);
      if (response.ok) metricsWithToken = true;
    }
    return response;
  }

  async function scrapeMetrics(mine) {
    let response;
    let body;
    try {
      response = await fetchMetrics();
      body = response.ok ? await response.text() : "";
    } catch (err) {
      if (mine !== generation) return;
      clearTurns();
      metricsNote("Metrics not available (the gateway does not answer).");
      return;
    }
    if (mine !== generation) return;
    if (!response.ok) {
      clearTurns();
      samples = [];
      metricsNote(
        response.status === 404
          ? "Metrics not available (this gateway has no /metrics)."
          : "Metrics not available (HTTP " + response.status + ")."
      );
      return;
    }
    const totals = turnsByMemory(body);
    if (totals === null) {
      clearTurns();
      metricsNote("No turns counted yet.");
      return;
    }
    const now = Date.now();
    samples.push({ at: now, totals: totals });
    while (samples.length > 2 && now - samples[1].at >= RATE_WINDOW_MS) samples.shift();
    for (const state of MEMORY_STATES) text("total-" + state, totals[state] || 0);
    if (samples.length < 2) {
      metricsNote("Measuring… (turns per minute need two scrapes)");
      return;
    }
    const first = samples[0];
    const minutes = (now - first.at) / 60000;
    for (const state of MEMORY_STATES) {
      let delta = (totals[state] || 0) - (first.totals[state] || 0);
      // A counter that went down is a restarted gateway: count from zero.
      if (delta < 0) delta = totals[state] || 0;
      text("tpm-" + state, (delta / minutes).toFixed(1));
    }
    metricsNote("Over the last " + Math.round((now - first.at) / 1000) + " s, from GET /metrics.");
  }

  // ---- recall tester ----
  async function recall(event) {
    event.preventDefault();
    const query = $("recall-query").value;
    const scope = $("recall-scope").value.trim();
    const limit = Number($("recall-limit").value || "5");
    const state = $("recall-state");
    const section = $("recall-section");
    const body = $("recall-memories").tBodies[0];
    if (!query.trim()) {
      state.textContent = "Type a query first.";
      $("recall-query").focus();
      return;
    }
    const params = { query: query, limit: limit };
    if (scope) params.scope = scope;
    state.textContent = "Recalling…";
    let result;
    try {
      result = await rpc("memory.recall", params);
    } catch (err) {
      state.textContent = "Recall failed: " + describe(err);
      section.textContent = "";
      body.replaceChildren();
      return;
    }
    const n = result.memories.length;
    state.textContent =
      "State: " + result.state + (result.section ? " — " + n + " memor" + (n === 1 ? "y" : "ies") + " injected" : " — nothing would be injected");
    section.textContent = result.section;
    const rows = document.createDocumentFragment();
    for (const m of result.memories) {
      const row = document.createElement("tr");
      cell(row, Number(m.score).toFixed(2), "nowrap", "Score");
      cell(row, m.node_type, "mono", "Node type");
      cell(row, m.text, "detail", "Text");
      rows.appendChild(row);
    }
    body.replaceChildren(rows);
  }

  // ---- episodes: a scope's, or those of no principal; searched, deleted, forgotten ----

  // Whether this token may act on memory of no principal, or everyone's: an admin's right in
  // user mode, anyone's in shared mode (read for display: the server decides).
  const mayActOnOthers = () => isAdmin() || scopeMode === "shared";

  function showMemoryChoices() {
    const allowed = mayActOnOthers();
    const anonymous = $("episodes-anonymous");
    $("episodes-anonymous-choice").hidden = !allowed;
    if (!allowed && anonymous.checked) {
      anonymous.checked = false;
      anonymousChosen();
    }
    $("forget-everything").hidden = !allowed;
  }

  // The turns of no principal have no scope: the scope field does not apply while chosen.
  function anonymousChosen() {
    $("episodes-scope").disabled = $("episodes-anonymous").checked;
  }

  function resetEpisodes() {
    closeQuestion(false);
    listing = null;
    episodesNext = null;
    $("episodes-table").tBodies[0].replaceChildren();
    $("episodes-more").hidden = true;
    $("forget-bar").hidden = true;
    $("episodes-note").textContent = "";
  }

  async function listEpisodes(event) {
    event.preventDefault();
    const anonymous = $("episodes-anonymous").checked && !$("episodes-anonymous-choice").hidden;
    const contains = $("episodes-contains").value;
    listing = {
      scope: anonymous ? null : $("episodes-scope").value.trim() || null,
      anonymous: anonymous,
      // As typed (a leading space can matter), unless blank.
      contains: contains.trim() ? contains : null,
    };
    await reloadEpisodes("");
  }

  // The listing again from its newest episode; ``said`` (a forget's outcome) leads the note.
  async function reloadEpisodes(said) {
    closeQuestion(false);
    $("episodes-table").tBodies[0].replaceChildren();
    await loadEpisodes(null, said);
  }

  // "of “alice”", "of your own scope", "of no principal": whose episodes a listing shows.
  function listedOf(l) {
    if (l.anonymous) return "of no principal";
    return "of " + (l.scope ? "“" + l.scope + "”" : "your own scope");
  }

  async function loadEpisodes(before, said) {
    const note = $("episodes-note");
    const more = $("episodes-more");
    const lead = said ? said + " " : "";
    const params = { limit: 50 };
    if (listing.anonymous) params.anonymous = true;
    else if (listing.scope) params.scope = listing.scope;
    if (listing.contains) params.contains = listing.contains;
    if (before) params.before = before;
    note.textContent = lead + "Loading…";
    let page;
    try {
      page = await rpc("memory.list", params);
    } catch (err) {
      note.textContent = lead + "Listing failed: " + describe(err);
      more.hidden = true;
      return;
    }
    const body = $("episodes-table").tBodies[0];
    for (const m of page.memories) body.appendChild(episodeRow(m));
    episodesNext = page.next;
    more.hidden = !episodesNext;
    showForget();
    const of = listedOf(listing);
    const match = listing.contains ? " whose preview holds “" + listing.contains + "”" : "";
    const count = body.rows.length;
    note.textContent = lead + (count
      ? count + " episode" + (count === 1 ? "" : "s") + " " + of + match + (episodesNext ? " (more below)" : "") + "."
      : "No episodes " + of + match + ".");
  }

  function episodeRow(m) {
    const row = document.createElement("tr");
    row.dataset.nodeId = m.node_id;
    timeCell(row, m.at, "At");
    cell(row, m.preview, "detail", "Preview");
    cell(row, m.node_id, "mono", "Node id");
    const td = cell(row, null, "actions");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "danger";
    button.textContent = "Delete";
    button.setAttribute("aria-label", "Delete episode " + m.preview);
    button.addEventListener("click", () => askDelete(row, m, button));
    td.appendChild(button);
    return row;
  }

  // Where the keyboard goes when the element it was on is gone.
  function focusEpisodesForm() {
    const scope = $("episodes-scope");
    (scope.disabled ? $("episodes-anonymous") : scope).focus();
  }

  // The open question, if any: {box, hide (what it stands in for), button (to focus back)}.
  // One at a time: a row's "Delete?" or the "Forget all" one.
  let asking = null;

  // Delete asks first, in the row itself: "Yes, delete" deletes; Cancel (or Escape) keeps the
  // episode. The focus starts on Cancel, so a second Enter never deletes by accident.
  function askDelete(row, m, button) {
    if (asking) closeQuestion(false);
    const box = document.createElement("span");
    box.className = "confirm";
    box.setAttribute("role", "group");
    box.setAttribute("aria-label", "Delete episode " + m.preview + "?");
    const question = document.createElement("span");
    question.textContent = "Delete?";
    const yes = document.createElement("button");
    yes.type = "button";
    yes.className = "danger solid";
    yes.textContent = "Yes, delete";
    const no = document.createElement("button");
    no.type = "button";
    no.textContent = "Cancel";
    box.append(question, yes, no);
    yes.addEventListener("click", () => deleteEpisode(row, m, box));
    no.addEventListener("click", () => {
      closeQuestion(true);
      $("episodes-note").textContent = "Kept episode " + m.node_id + ".";
    });
    escapeCancels(box, no);
    button.hidden = true;
    button.after(box);
    asking = { box: box, hide: button, button: button };
    $("episodes-note").textContent = "Delete episode " + m.node_id + "? It cannot be undone.";
    no.focus();
  }

  function escapeCancels(box, no) {
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.preventDefault();
        no.click();
      }
    });
  }

  // Closes the open question (only ``box``'s, when given: a list reloaded meanwhile has none).
  function closeQuestion(refocus, box) {
    if (!asking || (box && asking.box !== box)) return;
    asking.box.remove();
    asking.hide.hidden = false;
    if (refocus) asking.button.focus();
    asking = null;
  }

  async function deleteEpisode(row, m, box) {
    const note = $("episodes-note");
    const params = { node_id: m.node_id };
    // An episode of no principal has no scope to name: its id alone (any node in shared mode;
    // in user mode, an admin's delete of an indexed one).
    if (!listing.anonymous && listing.scope) params.scope = listing.scope;
    for (const b of box.querySelectorAll("button")) b.disabled = true;
    let result;
    try {
      result = await rpc("memory.delete", params);
    } catch (err) {
      closeQuestion(true, box);
      note.textContent = "Delete failed: " + describe(err);
      return;
    }
    if (!result.deleted) {
      closeQuestion(true, box);
      note.textContent = listing.anonymous
        ? "Not deleted: episode " + m.node_id + " is already gone."
        : "Not deleted: episode " + m.node_id + " is not in this scope, or is already gone.";
      return;
    }
    if (asking && asking.box === box) asking = null;
    // Keep the keyboard where it was: the next row's button, else the previous one's.
    const neighbour = row.nextElementSibling || row.previousElementSibling;
    row.remove();
    note.textContent = "Deleted episode " + m.node_id + ".";
    const next = neighbour ? neighbour.querySelector("button") : null;
    if (next) next.focus();
    else focusEpisodesForm();
  }

  // What a "Forget all" forgets: memory.forget's params, the button's and the question's
  // words, and whose conversations go with it (null: none do).
  function forgetTarget(everything) {
    if (everything) {
      return {
        params: { everything: true },
        button: "Forget everything",
        question: "Forget everything?",
        episodes: "every episode, of every scope and of no principal",
        conversations: "every conversation",
      };
    }
    const but = listing.contains ? "not only those matching “" + listing.contains + "”" : "not only those listed";
    if (listing.anonymous) {
      return {
        params: { anonymous: true },
        button: "Forget all turns of no principal",
        question: "Forget all turns of no principal?",
        episodes: "every episode of no principal (open REST turns), " + but,
        conversations: "the conversations of no principal",
      };
    }
    const scope = listing.scope;
    if (!scope) {
      const own = claims(token).sub;
      return {
        params: {},
        button: "Forget all of your own scope",
        question: "Forget all of your own scope?",
        episodes: "every episode of your own scope" + (own ? " (" + own + ")" : "") + ", " + but,
        conversations: "your conversations",
      };
    }
    // Conversations belong to a principal, not to a user it narrowed its turns to.
    const slash = scope.indexOf("/");
    return {
      params: { scope: scope },
      button: "Forget all of “" + scope + "”",
      question: "Forget all of “" + scope + "”?",
      episodes: "every episode of “" + scope + "”, " + but,
      conversations: slash < 0 ? "the conversations of “" + scope + "”" : null,
      owner: slash < 0 ? null : scope.slice(0, slash),
    };
  }

  function showForget() {
    const bar = $("forget-bar");
    $("forget-listed").textContent = forgetTarget(false).button;
    if (!(asking && asking.hide === bar)) bar.hidden = false;
  }

  // "Forget all" asks first, below the list, in the row delete's way: the question says what
  // goes (every episode, and whose conversations, unless kept), the focus starts on Cancel,
  // Escape cancels.
  function askForget(button, everything) {
    if (asking) closeQuestion(false);
    const target = forgetTarget(everything);
    const bar = $("forget-bar");
    const box = document.createElement("div");
    box.className = "confirm forget-question";
    box.setAttribute("role", "group");
    box.setAttribute("aria-label", target.question);
    box.setAttribute("aria-describedby", "forget-detail");
    const question = document.createElement("span");
    question.textContent = target.question;
    const detail = document.createElement("p");
    detail.id = "forget-detail";
    detail.textContent = "Erases " + target.episodes +
      (target.conversations
        ? ", and " + target.conversations + "."
        : "; conversations stay (they are the principal " + target.owner + "’s).") +
      " It cannot be undone.";
    box.append(question, detail);
    let keep = null;
    if (target.conversations) {
      const label = document.createElement("label");
      keep = document.createElement("input");
      keep.type = "checkbox";
      label.append(keep, " Keep " + target.conversations);
      box.appendChild(label);
    }
    const yes = document.createElement("button");
    yes.type = "button";
    yes.className = "danger solid";
    yes.textContent = "Yes, forget";
    const no = document.createElement("button");
    no.type = "button";
    no.textContent = "Cancel";
    box.append(yes, no);
    yes.addEventListener("click", () => forgetAll(target, box, keep));
    no.addEventListener("click", () => {
      closeQuestion(true);
      $("episodes-note").textContent = "Nothing forgotten.";
    });
    escapeCancels(box, no);
    bar.hidden = true;
    bar.after(box);
    asking = { box: box, hide: bar, button: button };
    $("episodes-note").textContent = target.question + " It cannot be undone.";
    no.focus();
  }

  function plural(n, word) {
    return count.format(n) + " " + word + (n === 1 ? "" : "s");
  }

  async function forgetAll(target, box, keep) {
    const note = $("episodes-note");
    const params = Object.assign({}, target.params);
    if (keep && keep.checked) params.keep_conversations = true;
    for (const b of box.querySelectorAll("button, input")) b.disabled = true;
    let result;
    try {
      result = await rpc("memory.forget", params);
    } catch (err) {
      closeQuestion(true, box);
      note.textContent = "Forget failed: " + describe(err);
      return;
    }
    closeQuestion(true, box);
    await reloadEpisodes(
      "Forgot " + plural(result.deleted, "episode") + " and " + plural(result.conversations, "conversation") + "."
    );
  }

  // ---- pages: #memory (the default) and #usage ----
  function showPage(focus) {
    const usage = location.hash === "#usage";
    $("memory-view").hidden = usage;
    $("usage-view").hidden = !usage;
    for (const [id, on] of [["nav-memory", !usage], ["nav-usage", usage]]) {
      if (on) $(id).setAttribute("aria-current", "page");
      else $(id).removeAttribute("aria-current");
    }
    if (usage && token) loadUsage(null);
    if (focus) $(usage ? "usage-title" : "status-title").focus();
  }

  // ---- usage: usage.summary by day and model (the chart, the models) and by principal ----
  const utcDay = (d) => d.toISOString().slice(0, 10);

  function defaultPeriod() {
    const now = new Date();
    if (!$("usage-to").value) $("usage-to").value = utcDay(now);
    if (!$("usage-from").value) $("usage-from").value = utcDay(now).slice(0, 8) + "01";
  }

  // Whether the token is an admin's (read for display: the server decides what it shows).
  const isAdmin = () => claims(token).role === "admin";

  // Whose usage the page shows, said above the figures: an admin's token sees everyone's, or
  // the principal typed in; any other token only its own principal's (usage.summary's rule),
  // so the field shows that principal and cannot be changed, and the page says how to see the
  // turns it does not own. ``principal`` is whose usage usage.summary last answered (its name
  // for a token the page cannot read, an API key's).
  function showUsageScope(principal) {
    const admin = isAdmin();
    const field = $("usage-principal");
    field.readOnly = !admin;
    $("usage-principal-hint").textContent = admin ? "(empty: everyone)" : "(yours only)";
    $("usage-others").hidden = admin;
    if (admin) {
      $("usage-scope").textContent = principal
        ? "Showing the usage of " + principal + " only."
        : "Showing everyone's usage, anonymous turns included.";
      return;
    }
    const own = principal || claims(token).sub || "";
    field.value = own;
    $("usage-scope").textContent = own
      ? "Showing only the usage of " + own + ", the principal you signed in as."
      : "Showing only the usage of the principal you signed in as.";
  }

  async function loadUsage(event) {
    if (event) event.preventDefault();
    defaultPeriod();
    const from = $("usage-from").value;
    const to = $("usage-to").value;
    // Only an admin names a principal; any other token is answered its own.
    const principal = isAdmin() ? $("usage-principal").value.trim() : "";
    const note = $("usage-note");
    if (to < from) {
      note.textContent = "The last day comes before the first.";
      return;
    }
    const params = { from: from, to: to };
    if (principal) params.principal = principal;
    note.textContent = "Loading…";
    let byDay;
    let byPrincipal;
    try {
      [byDay, byPrincipal] = await Promise.all([
        rpc("usage.summary", Object.assign({ group_by: ["day", "model"] }, params)),
        rpc("usage.summary", Object.assign({ group_by: ["principal"] }, params)),
      ]);
    } catch (err) {
      note.textContent = "Usage not shown: " + (err.code === NOT_ALLOWED ? err.message : describe(err));
      renderUsage(null, null, from, to);
      return;
    }
    renderUsage(byDay, byPrincipal, from, to);
    showUsageScope(byDay.principal);
    const t = byDay.totals;
    note.textContent =
      count.format(t.turns) + " turn" + (t.turns === 1 ? "" : "s") + ", " + count.format(t.total_tokens) +
      " tokens from " + from + " to " + to + (byDay.principal ? " for " + byDay.principal : "") +
      (byDay.truncated ? " (only the first rows)" : "") + ".";
  }

  // The days of [from, to] as YYYY-MM-DD, at most MAX_CHART_DAYS of them (the last ones).
  function daysOf(from, to) {
    const days = [];
    const day = new Date(from + "T00:00:00Z");
    const last = new Date(to + "T00:00:00Z");
    while (day <= last) {
      days.push(utcDay(day));
      day.setUTCDate(day.getUTCDate() + 1);
    }
    return days.slice(-MAX_CHART_DAYS);
  }

  // 1,234 -> "1.2k", for the chart's axis.
  function compact(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(n % 1e9 ? 1 : 0) + "G";
    if (n >= 1e6) return (n / 1e6).toFixed(n % 1e6 ? 1 : 0) + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(n % 1e3 ? 1 : 0) + "k";
    return String(n);
  }

  // The smallest 1, 2 or 5 times a power of ten at or above ``n``.
  function niceMax(n) {
    if (n <= 0) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(n)));
    for (const step of [1, 2, 5, 10]) if (step * power >= n) return step * power;
    return 10 * power;
  }

  function svg(name, attributes, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
    if (parent) parent.appendChild(node);
    return node;
  }

  function money(cost) {
    return cost === null || cost === undefined ? "—" : Number(cost).toFixed(4);
  }

  function usageRow(body, name, r, label) {
    const row = document.createElement("tr");
    cell(row, name, "mono", label);
    cell(row, count.format(r.turns), "num", "Turns");
    cell(row, count.format(r.prompt_tokens), "num", "Prompt");
    cell(row, count.format(r.completion_tokens), "num", "Completion");
    cell(row, count.format(r.total_tokens), "num", "Total");
    cell(row, count.format(r.memory_tokens), "num", "Memory");
    cell(row, count.format(r.estimated_turns), "num", "Estimated");
    cell(row, money(r.cost), "num", "Cost");
    body.appendChild(row);
  }

  function renderUsage(byDay, byPrincipal, from, to) {
    const chart = $("usage-chart");
    const legend = $("usage-legend");
    const models = $("usage-models").tBodies[0];
    const principals = $("usage-principals").tBodies[0];
    chart.replaceChildren();
    legend.replaceChildren();
    models.replaceChildren();
    principals.replaceChildren();
    const desc = svg("desc", { id: "usage-chart-desc" }, chart);
    const budget = $("usage-budget");
    budget.hidden = true;
    if (byDay === null) {
      desc.textContent = "No usage shown.";
      return;
    }

    // Per model: its total (for the order, the legend and the table) and its tokens per day.
    const perModel = new Map();
    for (const r of byDay.rows) {
      let m = perModel.get(r.model);
      if (!m) {
        m = { model: r.model, days: new Map(), turns: 0, prompt_tokens: 0, completion_tokens: 0,
              total_tokens: 0, memory_tokens: 0, estimated_turns: 0, cost: null };
        perModel.set(r.model, m);
      }
      m.days.set(r.day, (m.days.get(r.day) || 0) + r.total_tokens);
      for (const k of ["turns", "prompt_tokens", "completion_tokens", "total_tokens", "memory_tokens", "estimated_turns"]) m[k] += r[k];
      if (r.cost !== null) m.cost = (m.cost || 0) + r.cost;
    }
    const ordered = Array.from(perModel.values()).sort((a, b) => b.total_tokens - a.total_tokens || (a.model < b.model ? -1 : 1));
    const colour = new Map(ordered.map((m, i) => [m.model, COLOURS[i % COLOURS.length]]));

    const days = daysOf(from, to);
    const stacked = days.map((day) => ordered.reduce((sum, m) => sum + (m.days.get(day) || 0), 0));
    const top = niceMax(Math.max(0, ...stacked));
    const W = 800, H = 260, left = 52, right = 8, topPad = 10, bottom = 30;
    const plotW = W - left - right, plotH = H - topPad - bottom;
    for (let i = 0; i <= 4; i++) {
      const y = topPad + plotH - (plotH * i) / 4;
      svg("line", { class: "axis", x1: left, x2: W - right, y1: y, y2: y }, chart);
      const label = svg("text", { x: left - 6, y: y + 4, "text-anchor": "end" }, chart);
      label.textContent = compact((top * i) / 4);
    }
    const slot = plotW / days.length;
    const barW = Math.max(1, Math.min(40, slot * 0.72));
    const labelEvery = Math.ceil(days.length / 12);
    days.forEach((day, i) => {
      const x = left + slot * i + (slot - barW) / 2;
      let y = topPad + plotH;
      for (const m of ordered) {
        const tokens = m.days.get(day) || 0;
        if (!tokens) continue;
        const h = (plotH * tokens) / top;
        y -= h;
        const bar = svg("rect", { class: "bar", x: x.toFixed(2), y: y.toFixed(2), width: barW.toFixed(2),
                                  height: Math.max(h, 0.5).toFixed(2), fill: colour.get(m.model),
                                  "data-day": day, "data-model": m.model, "data-tokens": tokens }, chart);
        svg("title", {}, bar).textContent = day + " · " + m.model + ": " + count.format(tokens) + " tokens";
      }
      if (i % labelEvery === 0) {
        const label = svg("text", { x: (left + slot * i + slot / 2).toFixed(2), y: H - 10, "text-anchor": "middle" }, chart);
        label.textContent = day.slice(5);
      }
    });
    const busiest = stacked.indexOf(Math.max(...stacked));
    desc.textContent = ordered.length
      ? "Tokens per day from " + from + " to " + to + ", stacked by model (" +
        ordered.map((m) => m.model + " " + count.format(m.total_tokens)).join(", ") +
        "); the busiest day was " + days[busiest] + " with " + count.format(stacked[busiest]) + " tokens."
      : "No tokens from " + from + " to " + to + ".";

    for (const m of ordered) {
      const item = document.createElement("li");
      const swatch = svg("svg", { width: 12, height: 12, viewBox: "0 0 12 12", "aria-hidden": "true" });
      svg("rect", { width: 12, height: 12, rx: 2, fill: colour.get(m.model) }, swatch);
      const name = document.createElement("span");
      name.textContent = m.model + " (" + count.format(m.total_tokens) + ")";
      item.append(swatch, name);
      legend.appendChild(item);
      usageRow(models, m.model, m, "Model");
    }
    if (!ordered.length) {
      const row = document.createElement("tr");
      cell(row, "No turns in this period.").colSpan = 8;
      models.appendChild(row);
    }
    for (const r of byPrincipal.rows) usageRow(principals, r.principal, r, "Principal");
    if (!byPrincipal.rows.length) {
      const row = document.createElement("tr");
      cell(row, "No turns in this period.").colSpan = 8;
      principals.appendChild(row);
    }

    const b = byDay.budget;
    if (b) {
      const parts = [];
      let spent = false;
      if (b.tokens !== null) {
        parts.push(count.format(b.spent_tokens) + " of " + count.format(b.tokens) + " tokens");
        spent = spent || b.spent_tokens >= b.tokens;
      }
      if (b.cost !== null) {
        parts.push(money(b.spent_cost) + " of " + money(b.cost));
        spent = spent || b.spent_cost >= b.cost;
      }
      budget.textContent = "Budget for " + b.month + " (UTC): " + parts.join(" and ") + " spent" + (spent ? " — used up: turns are refused until next month." : ".");
      budget.className = spent ? "spent" : "";
      budget.hidden = false;
    }
  }

  // ---- wiring ----
  function init() {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      signIn($("token").value.trim(), false);
    });
    $("sign-out").addEventListener("click", () => signOut("Signed out."));
    $("recall-form").addEventListener("submit", recall);
    $("episodes-form").addEventListener("submit", listEpisodes);
    $("episodes-more").addEventListener("click", () => loadEpisodes(episodesNext, ""));
    $("episodes-anonymous").addEventListener("change", anonymousChosen);
    $("forget-listed").addEventListener("click", (event) => askForget(event.currentTarget, false));
    $("forget-everything").addEventListener("click", (event) => askForget(event.currentTarget, true));
    $("usage-form").addEventListener("submit", loadUsage);
    window.addEventListener("hashchange", () => {
      if (token) showPage(true);
    });
    // Headings that take focus after sign-in, for screen readers and keyboards.
    $("status-title").tabIndex = -1;
    $("usage-title").tabIndex = -1;
    anonymousChosen();
    const zone = timeZoneName();
    for (const node of document.querySelectorAll(".time-zone")) node.textContent = zone;
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) {
      signIn(saved, true);
    } else {
      $("token").focus();
    }
  }

  init();
})();
