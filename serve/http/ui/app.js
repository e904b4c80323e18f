// The page of `laplace serve`: chat with the model, watch the server, manage its sessions.
// Hand-written, no framework, no build step. Everything the page shows that came from the
// server or the model is untrusted text: it is put into the page with textContent and
// createElement only, never parsed as HTML. Every request goes to the server that served
// the page (relative URLs; the Content-Security-Policy's connect-src 'self' enforces it).
"use strict";

const KEY_STORAGE = "laplace.apiKey";
const $ = (id) => document.getElementById(id);

// ---- small helpers ----------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", Boolean(bad));
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

// fetch() against this server, with the API key when the page has one.
function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  return fetch(path, Object.assign({}, options, { headers, credentials: "omit", cache: "no-store" }));
}

// The message of an error answer (the OpenAI error object), or the status line.
async function errorText(resp) {
  try {
    const j = await resp.json();
    if (j && j.error && j.error.message) return resp.status + ": " + j.error.message;
  } catch (_) { /* not JSON */ }
  return resp.status + " " + resp.statusText;
}

function needKey(resp) {
  if (resp.status !== 401) return false;
  setStatus("This server needs an API key: enter it under Sampling and settings.", true);
  document.querySelector("details.settings").open = true;
  return true;
}

function fmtNumber(v, digits = 0) {
  if (v === undefined || v === null || !isFinite(v)) return "–";
  return v.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function fmtBytes(v) {
  if (v === undefined || !isFinite(v)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return fmtNumber(v, i ? 1 : 0) + " " + units[i];
}

function fmtSeconds(s) {
  if (s === undefined || s === null || !isFinite(s)) return "–";
  return s < 1 ? fmtNumber(s * 1000, 1) + " ms" : fmtNumber(s, 2) + " s";
}

// ---- tabs ------------------------------------------------------------------------------------

const TABS = ["chat", "server", "sessions"];
let currentView = "chat";

function showView(name, focus) {
  currentView = name;
  for (const t of TABS) {
    const tab = $("tab-" + t);
    const on = t === name;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $("view-" + t).hidden = !on;
    if (on && focus) tab.focus();
  }
  if (name === "server") pollMetrics();
  if (name === "sessions") loadSessions();
}

function initTabs() {
  TABS.forEach((t, i) => {
    const tab = $("tab-" + t);
    tab.addEventListener("click", () => showView(t, false));
    // Arrow keys move between tabs (the WAI-ARIA tabs pattern).
    tab.addEventListener("keydown", (ev) => {
      let j = -1;
      if (ev.key === "ArrowRight") j = (i + 1) % TABS.length;
      else if (ev.key === "ArrowLeft") j = (i + TABS.length - 1) % TABS.length;
      else if (ev.key === "Home") j = 0;
      else if (ev.key === "End") j = TABS.length - 1;
      if (j < 0) return;
      ev.preventDefault();
      showView(TABS[j], true);
    });
  });
}

// ---- chat ------------------------------------------------------------------------------------

// Behind a fleet's balancer (docs/deployment.md), requests with one X-Laplace-Affinity key
// reach one replica. A conversation gets a random key, so each turn reaches the replica whose
// state cache holds the previous turn's state; a raw completion, a hash of its prompt's first
// 256 characters, so prompts sharing that prefix meet their cached states; a request that
// continues or keeps a named session, that name.
function randomKey() {
  return "c-" + Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, "0")).join("");
}
function promptKey(prompt) {
  let h = 0x811c9dc5;  // FNV-1a: a routing key, not a digest
  for (const ch of prompt.slice(0, 256)) h = Math.imul(h ^ ch.codePointAt(0), 0x01000193) >>> 0;
  return "p-" + h.toString(16).padStart(8, "0");
}

const chat = {
  messages: [],     // {role, content}: the conversation sent with each chat request
  key: randomKey(), // the conversation's affinity key (a new one when it is cleared)
  lastPrompt: null, // completion mode: the last raw prompt (for Regenerate)
  controller: null, // the running request's AbortController
  lastBubble: null, // the last reply's element (Regenerate replaces it)
};

function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function numberField(id) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const n = Number(v);
  return isFinite(n) ? n : undefined;
}

// The request body's sampling fields, from the settings panel.
function samplingFields() {
  const b = {};
  const t = numberField("temperature"); if (t !== undefined) b.temperature = t;
  const p = numberField("top_p"); if (p !== undefined) b.top_p = p;
  const k = numberField("top_k"); if (k !== undefined) b.top_k = Math.trunc(k);
  const m = numberField("max_tokens"); if (m !== undefined) b.max_tokens = Math.trunc(m);
  const s = numberField("seed"); if (s !== undefined) b.seed = Math.trunc(s);
  if ($("ignore_eos").checked) b.ignore_eos = true;
  const session = $("session").value.trim(); if (session) b.session = session;
  const save = $("save_session").value.trim(); if (save) b.save_session = save;
  return b;
}

function addBubble(role, label) {
  const m = el("div", "msg " + role);
  m.appendChild(el("div", "who", label));
  const text = el("pre", "text");
  m.appendChild(text);
  const box = $("transcript");
  box.appendChild(m);
  box.scrollTop = box.scrollHeight;
  return m;
}

// The transcript scrolls by itself only while its end is in view: a reader who scrolled up
// stays where they are, and the controls below it never move.
function nearEnd(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !canRegenerate();
  document.body.dataset.streaming = busy ? "1" : "0";
}

function canRegenerate() {
  if (mode() === "chat") return chat.messages.length > 0;
  return chat.lastPrompt !== null;
}

// Reads an SSE body: calls onData with each event's parsed JSON until "[DONE]".
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // comments (": keep-alive") and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

// Streams one reply into `bubble`; returns the generated text.
async function streamReply(bubble, endpoint, body, affinity) {
  const textNode = bubble.querySelector(".text");
  const out = document.createTextNode("");
  textNode.appendChild(out);
  const stats = el("div", "stats", "waiting for the first token…");
  bubble.appendChild(stats);
  chat.controller = new AbortController();
  bubble.setAttribute("aria-busy", "true");  // screen readers read the reply once, when done
  setBusy(true);
  const t0 = performance.now();
  let tFirst = 0, tLast = 0, chunks = 0, usageTokens = -1, stopped = false, failed = "";
  // Text reaches the page at most once a frame: a local model streams thousands of tokens a
  // second, and laying the transcript out for each (to keep it scrolled to the end) would
  // take the page's whole time as the reply grows.
  let unshown = "", frame = 0;
  const show = () => {
    frame = 0;
    if (!unshown) return;
    const box = $("transcript"), follow = nearEnd(box);
    out.appendData(unshown);
    unshown = "";
    if (follow) box.scrollTop = box.scrollHeight;
    stats.textContent = "streaming…";
  };
  try {
    // A named session routes by its name: the replica that holds it (or loads it).
    const route = body.session || body.save_session || affinity;
    const resp = await api(endpoint, {
      method: "POST",
      headers: { "X-Laplace-Affinity": route },
      body: JSON.stringify(Object.assign(body, { stream: true, stream_options: { include_usage: true } })),
      signal: chat.controller.signal,
    });
    if (!resp.ok) {
      if (!needKey(resp)) failed = await errorText(resp);
      else failed = "401: missing or wrong API key";
    } else {
      await readEvents(resp, (j) => {
        if (j.error) { failed = j.error.message || "error"; return; }
        if (j.usage) usageTokens = j.usage.completion_tokens;
        for (const c of j.choices || []) {
          const piece = c.delta ? c.delta.content : c.text;
          if (!piece) continue;
          if (!tFirst) tFirst = performance.now();
          tLast = performance.now();
          chunks++;
          unshown += piece;
          if (!frame) frame = requestAnimationFrame(show);
        }
      });
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else failed = String(e.message || e);
  }
  if (frame) cancelAnimationFrame(frame);
  show();  // what arrived since the last frame
  chat.controller = null;
  // The usage comes with the stream's end; a stopped stream has none, and its pieces (one or
  // more tokens each, as the server batches them) give a lower bound.
  const n = usageTokens >= 0 ? usageTokens : chunks;
  const parts = [(usageTokens >= 0 ? "" : "~") + n + " tokens"];
  if (tFirst) parts.push("TTFT " + fmtSeconds((tFirst - t0) / 1000));
  if (n > 1 && tLast > tFirst) parts.push(fmtNumber((n - 1) / ((tLast - tFirst) / 1000), 1) + " tok/s");
  if (stopped) parts.push("stopped");
  stats.textContent = parts.join(" · ");
  if (failed) {
    bubble.classList.add("error");
    bubble.appendChild(el("div", "stats", "Error: " + failed));
  }
  bubble.dataset.done = stopped ? "stopped" : failed ? "error" : "done";
  bubble.removeAttribute("aria-busy");
  setBusy(false);
  return { text: out.data, ok: !failed };
}

async function runChat() {
  const bubble = addBubble("bot", "Model");
  chat.lastBubble = bubble;
  const body = Object.assign({ messages: chat.messages.slice() }, samplingFields());
  const r = await streamReply(bubble, "/v1/chat/completions", body, chat.key);
  // A stopped reply stays in the conversation as far as it went (as llama.cpp's page does),
  // unless the conversation was cleared meanwhile (its bubble is gone).
  if (bubble.isConnected && (r.ok || r.text)) chat.messages.push({ role: "assistant", content: r.text });
  setBusy(false);
}

async function runCompletion(prompt) {
  const bubble = addBubble("bot", "Completion");
  bubble.querySelector(".text").appendChild(el("span", "prompt", prompt));
  chat.lastBubble = bubble;
  chat.lastPrompt = prompt;
  await streamReply(bubble, "/v1/completions", Object.assign({ prompt }, samplingFields()), promptKey(prompt));
  setBusy(false);
}

async function send() {
  if (chat.controller) return;
  const prompt = $("prompt").value;
  if (mode() === "chat") {
    if (!prompt.trim()) return;
    chat.messages.push({ role: "user", content: prompt });
    addBubble("user", "You").querySelector(".text").textContent = prompt;
    $("prompt").value = "";
    await runChat();
  } else {
    await runCompletion(prompt);
  }
}

async function regenerate() {
  if (chat.controller || !canRegenerate()) return;
  if (chat.lastBubble) chat.lastBubble.remove();
  chat.lastBubble = null;
  if (mode() === "chat") {
    // The last reply is asked again; after a failed one (no reply kept), the last message is.
    if (chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
    await runChat();
  } else {
    await runCompletion(chat.lastPrompt);
  }
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function clearChat() {
  stop();
  chat.messages = [];
  chat.key = randomKey();
  chat.lastPrompt = null;
  chat.lastBubble = null;
  $("transcript").replaceChildren();
  setBusy(false);
}

function initChat() {
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    if (ev.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clearChat);
  for (const r of document.querySelectorAll('input[name="mode"]')) {
    r.addEventListener("change", () => {
      clearChat();
      const chatMode = mode() === "chat";
      $("prompt-label").textContent = chatMode ? "Message" : "Prompt (raw text)";
      $("prompt").placeholder = chatMode
        ? "Type a message; Enter sends, Shift+Enter starts a new line"
        : "Raw text the model continues; Enter sends, Shift+Enter starts a new line";
    });
  }
  const key = $("api-key");
  key.value = apiKey();
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORAGE, key.value);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModel();
  });
}

async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) {
      if (needKey(resp)) return;
      setStatus(await errorText(resp), true);
      if (resp.status === 503) setTimeout(loadModel, 2000);  // loading: ask again
      return;
    }
    const j = await resp.json();
    const id = j.data && j.data[0] ? j.data[0].id : "";
    $("model-name").textContent = id;
    setStatus("ready");
  } catch (e) {
    setStatus("server unreachable: " + (e.message || e), true);
  }
}

// ---- the server view (/metrics) -------------------------------------------------------------

// Parses Prometheus text: plain samples by name, histograms as sorted [le, cumulative count].
function parseMetrics(text) {
  const values = new Map();
  const buckets = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const v = Number(m[4]);
    if (m[1].endsWith("_bucket") && m[3]) {
      const le = /le="([^"]*)"/.exec(m[3]);
      if (!le) continue;
      const name = m[1].slice(0, -"_bucket".length);
      if (!buckets.has(name)) buckets.set(name, []);
      buckets.get(name).push([le[1] === "+Inf" ? Infinity : Number(le[1]), v]);
    } else if (!m[3]) {
      values.set(m[1], v);
    }
  }
  for (const b of buckets.values()) b.sort((x, y) => x[0] - y[0]);
  return { values, buckets };
}

// The q-quantile of a cumulative histogram, interpolated linearly inside its bucket (as
// Prometheus's histogram_quantile does). Undefined when it is empty.
function quantile(q, b) {
  if (!b || !b.length) return undefined;
  const total = b[b.length - 1][1];
  if (!total) return undefined;
  const rank = q * total;
  let prevLe = 0, prevCount = 0;
  for (const [le, count] of b) {
    if (count >= rank) {
      if (le === Infinity) return prevLe;  // beyond the last bound: its lower edge
      const inBucket = count - prevCount;
      return inBucket ? prevLe + (le - prevLe) * ((rank - prevCount) / inBucket) : le;
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}

const metrics = { prev: null, prevT: 0, history: [], timer: 0, busy: false };
const HISTORY = 60;  // samples, one a second

function rate(name, cur, dt) {
  // No rate across a gap (the view was hidden): it would be an average, not a rate.
  if (!metrics.prev || dt <= 0 || dt > 5) return undefined;
  const a = metrics.prev.values.get(name), b = cur.values.get(name);
  if (a === undefined || b === undefined) return undefined;
  return Math.max(0, (b - a) / dt);
}

function card(label, value, id) {
  const c = el("div", "card");
  c.dataset.metric = id;
  c.appendChild(el("div", "label", label));
  c.appendChild(el("div", "value", value));
  return c;
}

function renderMetrics(cur, dt) {
  const v = (n) => cur.values.get(n);
  const used = v("laplace_state_slots_used"), free = v("laplace_state_slots_free");
  const hits = v("laplace_cache_hits_total"), misses = v("laplace_cache_misses_total");
  // The engine's counters move every step; the request counters only when a request ends.
  const genRate = rate("laplace_decode_tokens_total", cur, dt);
  const promptRate = rate("laplace_prefill_tokens_total", cur, dt);
  const cards = [
    card("Ready", v("laplace_ready") ? "yes" : "loading", "ready"),
    card("Live sequences", fmtNumber(v("laplace_requests_running")), "running"),
    card("Queued sequences", fmtNumber(v("laplace_requests_waiting")), "queued"),
    card("State slots used", used === undefined ? "–" : fmtNumber(used) + " / " + fmtNumber(used + free), "slots"),
    card("Decode tokens/s", fmtNumber(genRate, 1), "tps"),
    card("Prefill tokens/s", fmtNumber(promptRate, 1), "prefill-tps"),
    card("Cache entries", fmtNumber(v("laplace_cache_entries")), "cache-entries"),
    card("Cache hit rate", hits + misses > 0 ? fmtNumber((100 * hits) / (hits + misses), 1) + " %" : "–", "cache-hits"),
    card("Cache device slots", v("laplace_cache_device_slots") === undefined ? "–"
      : fmtNumber(v("laplace_cache_device_slots_used")) + " / " + fmtNumber(v("laplace_cache_device_slots")), "cache-device"),
    card("Cache host bytes", fmtBytes(v("laplace_cache_bytes")), "cache-bytes"),
    card("Sessions", fmtNumber(v("laplace_sessions")), "sessions"),
    card("Generated tokens (ended requests)", fmtNumber(v("laplace_generation_tokens_total")), "gen-total"),
    card("HTTP connections", fmtNumber(v("laplace_http_connections")), "connections"),
    card("Rejected (429)", fmtNumber(v("laplace_requests_rejected_total")), "rejected"),
    card("Resident memory", fmtBytes(v("laplace_process_resident_bytes")), "rss"),
  ];
  $("cards").replaceChildren(...cards);

  const rows = [
    ["Time to first token", "laplace_time_to_first_token_seconds"],
    ["Time per output token", "laplace_inter_token_latency_seconds"],
    ["Request (end to end)", "laplace_e2e_request_latency_seconds"],
    ["Queue time", "laplace_queue_time_seconds"],
  ].map(([label, name]) => {
    const b = cur.buckets.get(name);
    const tr = el("tr");
    tr.appendChild(el("th", "", label)).scope = "row";
    for (const q of [0.5, 0.9, 0.99]) tr.appendChild(el("td", "", fmtSeconds(quantile(q, b))));
    tr.appendChild(el("td", "", fmtNumber(b && b.length ? b[b.length - 1][1] : undefined)));
    return tr;
  });
  $("latency").tBodies[0].replaceChildren(...rows);

  metrics.history.push({ tps: genRate || 0, running: v("laplace_requests_running") || 0,
                         queued: v("laplace_requests_waiting") || 0 });
  if (metrics.history.length > HISTORY) metrics.history.shift();
  drawChart($("chart-tps"), [metrics.history.map((h) => h.tps)], ["#2b7bd0"]);
  drawChart($("chart-seq"), [metrics.history.map((h) => h.running), metrics.history.map((h) => h.queued)],
            ["#2b7bd0", "#d0702b"]);
}

// A small line chart of the last HISTORY samples; the y axis starts at 0, its top is labelled.
function drawChart(canvas, series, colors) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  let max = 1;
  for (const s of series) for (const x of s) max = Math.max(max, x);
  const style = getComputedStyle(document.documentElement);
  g.strokeStyle = style.getPropertyValue("--line");
  g.lineWidth = 1;
  g.beginPath(); g.moveTo(0, h - 0.5); g.lineTo(w, h - 0.5); g.stroke();
  g.fillStyle = style.getPropertyValue("--muted");
  g.font = "11px system-ui, sans-serif";
  g.fillText(fmtNumber(max, max < 10 ? 1 : 0), 2, 11);
  series.forEach((s, i) => {
    g.strokeStyle = colors[i];
    g.lineWidth = 1.5;
    g.beginPath();
    s.forEach((x, j) => {
      const px = (w * (j + HISTORY - s.length)) / (HISTORY - 1);
      const py = h - 2 - (h - 16) * (x / max);
      if (j) g.lineTo(px, py); else g.moveTo(px, py);
    });
    g.stroke();
  });
}

async function pollMetrics() {
  clearTimeout(metrics.timer);
  // One poll at a time: the one in flight schedules the next.
  if (currentView !== "server" || metrics.busy) return;
  metrics.busy = true;
  try {
    const resp = await api("/metrics");
    if (resp.ok) {
      const cur = parseMetrics(await resp.text());
      const now = performance.now() / 1000;
      renderMetrics(cur, metrics.prev ? now - metrics.prevT : 0);
      metrics.prev = cur;
      metrics.prevT = now;
    } else if (!needKey(resp)) {
      setStatus("/metrics: " + (await errorText(resp)), true);
    }
  } catch (e) {
    setStatus("/metrics: " + (e.message || e), true);
  }
  metrics.busy = false;
  if (currentView === "server") metrics.timer = setTimeout(pollMetrics, 1000);
}

// ---- sessions ----------------------------------------------------------------------------------

const sessionPath = (name) => "/v1/sessions/" + encodeURIComponent(name);

async function sessionCall(what, path, body, method = "POST") {
  try {
    const resp = await api(path, { method, body: body === undefined ? undefined : JSON.stringify(body) });
    if (!resp.ok) {
      if (!needKey(resp)) setStatus(what + ": " + (await errorText(resp)), true);
      return null;
    }
    const j = await resp.json();
    setStatus(what + ": done");
    return j;
  } catch (e) {
    setStatus(what + ": " + (e.message || e), true);
    return null;
  }
}

function sessionRow(s) {
  const tr = el("tr");
  tr.appendChild(el("th", "mono", s.name)).scope = "row";
  tr.appendChild(el("td", "", fmtNumber(s.tokens)));
  tr.appendChild(el("td", "", fmtBytes(s.state_bytes)));
  const actions = el("td", "actions");
  const button = (label, onClick) => {
    const b = el("button", "", label);
    b.type = "button";
    b.setAttribute("aria-label", label + " session " + s.name);
    b.addEventListener("click", onClick);
    actions.appendChild(b);
    return b;
  };
  button("View", async () => {
    const j = await sessionCall("view " + s.name, sessionPath(s.name), undefined, "GET");
    if (!j) return;
    const pre = $("session-text");
    pre.textContent = j.text === undefined ? "(the tokens do not decode to text)" : j.text;
    pre.hidden = false;
  });
  button("Use in chat", () => {
    $("session").value = s.name;
    showView("chat", true);
    setStatus("new replies start from session " + s.name);
  });
  button("Save", () => sessionCall("save " + s.name, sessionPath(s.name) + "/save", {}));
  const forkName = el("input");
  forkName.type = "text";
  forkName.placeholder = "fork name";
  forkName.setAttribute("aria-label", "Name of the fork of session " + s.name);
  actions.appendChild(forkName);
  button("Fork", async () => {
    if (!forkName.value.trim()) { forkName.focus(); return; }
    if (await sessionCall("fork " + s.name, sessionPath(s.name) + "/fork", { name: forkName.value.trim() })) loadSessions();
  });
  button("Delete", async () => {
    if (await sessionCall("delete " + s.name, sessionPath(s.name), undefined, "DELETE")) loadSessions();
  });
  tr.appendChild(actions);
  return tr;
}

async function loadSessions() {
  try {
    const resp = await api("/v1/sessions");
    if (!resp.ok) {
      if (!needKey(resp)) setStatus("sessions: " + (await errorText(resp)), true);
      return;
    }
    const j = await resp.json();
    const list = (j.data || []).slice().sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
    $("sessions").tBodies[0].replaceChildren(...list.map(sessionRow));
    $("sessions-empty").hidden = list.length > 0;
  } catch (e) {
    setStatus("sessions: " + (e.message || e), true);
  }
}

function initSessions() {
  $("sessions-refresh").addEventListener("click", loadSessions);
  $("session-create").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("new-session-name").value.trim();
    if (await sessionCall("create " + name, "/v1/sessions", { name, prompt: $("new-session-prompt").value })) {
      $("new-session-name").value = "";
      $("new-session-prompt").value = "";
      loadSessions();
    }
  });
  $("session-restore").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("restore-name").value.trim();
    if (await sessionCall("restore " + name, sessionPath(name) + "/restore", {})) loadSessions();
  });
}

// ---- start ---------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  initTabs();
  initChat();
  initSessions();
  setBusy(false);
  loadModel();
});
