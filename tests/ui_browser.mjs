// Drives the page of `laplace serve` in headless Chromium (tests/ui_browser.sh starts the
// server). No npm package: Chromium's DevTools protocol over --remote-debugging-pipe (fd 3
// carries commands to the browser, fd 4 its answers and events, each a JSON message ended by
// a NUL byte). Every wait is bounded; any failed check, page exception or console error
// (a Content-Security-Policy violation is one) fails the test.
// Usage: node tests/ui_browser.mjs  (LAPLACE_URL, LAPLACE_API_KEY, CHROMIUM; optional
// LAPLACE_UI_SCREENSHOTS: a directory for ui-chat.png, ui-metrics.png and ui-phone.png)
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const URL = process.env.LAPLACE_URL;
const KEY = process.env.LAPLACE_API_KEY;
const CHROMIUM = process.env.CHROMIUM || "chromium";
const SHOTS = process.env.LAPLACE_UI_SCREENSHOTS || "";
if (!URL || !KEY) throw new Error("set LAPLACE_URL and LAPLACE_API_KEY");

const started = Date.now();
let passed = 0;
function ok(what) {
  passed++;
  console.log(`ok ${passed} - ${what} (${((Date.now() - started) / 1000).toFixed(1)} s)`);
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the browser and the protocol --------------------------------------------------------------

const profile = mkdtempSync(join(tmpdir(), "laplace-ui-"));
const chrome = spawn(CHROMIUM, [
  "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", `--user-data-dir=${profile}`,
  "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
  "--disable-sync", "--disable-component-update", "--hide-scrollbars", "--mute-audio", "about:blank",
], { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] });
let chromeErr = "";
chrome.stderr.on("data", (d) => { chromeErr = (chromeErr + d).slice(-4000); });
const toChrome = chrome.stdio[3];
const fromChrome = chrome.stdio[4];

let nextId = 1;
const pending = new Map();
const listeners = [];
const problems = [];  // page exceptions and console errors
let inbox = Buffer.alloc(0);
fromChrome.on("data", (data) => {
  inbox = Buffer.concat([inbox, data]);
  let end;
  while ((end = inbox.indexOf(0)) >= 0) {
    const msg = JSON.parse(inbox.subarray(0, end).toString("utf8"));
    inbox = inbox.subarray(end + 1);
    if (msg.id && pending.has(msg.id)) {
      const { resolve, reject, method } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(`${method}: ${msg.error.message}`));
      else resolve(msg.result);
    } else if (msg.method) {
      for (const l of listeners.slice()) l(msg);
    }
  }
});

function send(method, params = {}, sessionId, timeoutMs = 30000) {
  const id = nextId++;
  const msg = { id, method, params };
  if (sessionId) msg.sessionId = sessionId;
  toChrome.write(JSON.stringify(msg) + "\0");
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => { pending.delete(id); reject(new Error(`${method}: no answer in ${timeoutMs} ms`)); }, timeoutMs);
    pending.set(id, {
      method,
      resolve: (r) => { clearTimeout(t); resolve(r); },
      reject: (e) => { clearTimeout(t); reject(e); },
    });
  });
}

function waitEvent(name, timeoutMs) {
  return new Promise((resolve, reject) => {
    const l = (msg) => {
      if (msg.method !== name) return;
      listeners.splice(listeners.indexOf(l), 1);
      clearTimeout(t);
      resolve(msg.params);
    };
    const t = setTimeout(() => { listeners.splice(listeners.indexOf(l), 1); reject(new Error(`no ${name} in ${timeoutMs} ms`)); }, timeoutMs);
    listeners.push(l);
  });
}

let session = "";
// Runs in the page: keeps {chat, key, session} of each completion request in
// window.__laplaceAffinity.
function recordAffinity() {
  const seen = (window.__laplaceAffinity = []);
  const original = window.fetch.bind(window);
  window.fetch = (url, options = {}) => {
    if (/\/v1\/(chat\/)?completions$/.test(String(url))) {
      let body = {};
      try { body = JSON.parse(options.body || "{}"); } catch (_) { /* not JSON: no session */ }
      seen.push({ chat: /chat/.test(String(url)), key: (options.headers || {})["X-Laplace-Affinity"] || "",
                  session: body.session || "" });
    }
    return original(url, options);
  };
}
const cmd = (method, params, timeoutMs) => send(method, params, session, timeoutMs);

async function evaluate(expression) {
  const r = await cmd("Runtime.evaluate", { expression, awaitPromise: true, returnByValue: true });
  if (r.exceptionDetails) throw new Error(`evaluate(${expression}): ${r.exceptionDetails.exception?.description || r.exceptionDetails.text}`);
  return r.result.value;
}

// Polls `expression` until it is truthy; fails with `what` after timeoutMs.
async function waitFor(expression, what, timeoutMs = 30000) {
  const until = Date.now() + timeoutMs;
  let last;
  while (Date.now() < until) {
    last = await evaluate(expression);
    if (last) return last;
    await sleep(100);
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what} (last: ${JSON.stringify(last)})`);
}

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  ok(what);
}

async function key(keyName, code, vk, text) {
  const base = { key: keyName, code, windowsVirtualKeyCode: vk, nativeVirtualKeyCode: vk };
  await cmd("Input.dispatchKeyEvent", Object.assign({ type: text ? "keyDown" : "rawKeyDown", text }, base));
  await cmd("Input.dispatchKeyEvent", Object.assign({ type: "keyUp" }, base));
}

// A real mouse click in the middle of the element `selector`. The events land where the element
// was when its box was read, and streaming text can move the layout in between; so a listener of
// our own counts the clicks the element receives, and a click that missed it is made again (a few
// times, then the test fails). A click that arrived is never repeated.
async function click(selector) {
  const sel = JSON.stringify(selector);
  await evaluate(`(() => { const e = document.querySelector(${sel}); e.testClicks = 0;
    e.addEventListener("click", () => ++e.testClicks, {once: true}); })()`);
  for (let attempt = 0; attempt < 5; ++attempt) {
    const r = await evaluate(`(() => { const e = document.querySelector(${sel});
      e.scrollIntoView({block: "center"}); const b = e.getBoundingClientRect();
      return {x: b.x + b.width / 2, y: b.y + b.height / 2}; })()`);
    for (const type of ["mousePressed", "mouseReleased"])
      await cmd("Input.dispatchMouseEvent", { type, x: r.x, y: r.y, button: "left", clickCount: 1 });
    if (await evaluate(`(document.querySelector(${sel})?.testClicks ?? 1) > 0`)) return;
  }
  throw new Error(`${selector}: five clicks missed it`);
}

async function typeInto(selector, text) {
  await evaluate(`document.querySelector(${JSON.stringify(selector)}).focus()`);
  await cmd("Input.insertText", { text });
}

async function screenshot(name) {
  if (!SHOTS) return;
  const { data } = await cmd("Page.captureScreenshot", { format: "png" });
  writeFileSync(join(SHOTS, name), Buffer.from(data, "base64"));
  console.log(`# wrote ${join(SHOTS, name)}`);
}

async function viewport(width, height, mobile) {
  await cmd("Emulation.setDeviceMetricsOverride", { width, height, deviceScaleFactor: 1, mobile });
}

async function load() {
  const loaded = waitEvent("Page.loadEventFired", 30000);
  await cmd("Page.navigate", { url: URL + "/" });
  await loaded;
}

// The page is no wider than the window: nothing scrolls sideways.
async function noHorizontalOverflow(what) {
  const r = await evaluate(`({sw: document.documentElement.scrollWidth, w: window.innerWidth})`);
  check(r.sw <= r.w, `${what}: no horizontal overflow at ${r.w} px (content ${r.sw} px)`);
}

// ---- the test ----------------------------------------------------------------------------------

async function main() {
  await new Promise((resolve, reject) => { chrome.once("spawn", resolve); chrome.once("error", reject); });
  const { targetInfos } = await send("Target.getTargets");
  const page = targetInfos.find((t) => t.type === "page");
  if (!page) throw new Error("no page target");
  ({ sessionId: session } = await send("Target.attachToTarget", { targetId: page.targetId, flatten: true }));
  listeners.push((msg) => {
    if (msg.method === "Runtime.exceptionThrown") problems.push("exception: " + JSON.stringify(msg.params.exceptionDetails).slice(0, 400));
    if (msg.method === "Runtime.consoleAPICalled" && msg.params.type === "error")
      problems.push("console.error: " + JSON.stringify(msg.params.args).slice(0, 400));
    if (msg.method === "Log.entryAdded" && msg.params.entry.level === "error") {
      const e = msg.params.entry;
      // API answers the page handles are by design: the 401 before the key is entered, the 400
      // for a bad session name. Anything else (a missing file, a blocked one) is a problem.
      if (!(e.source === "network" && /status of 40[01] /.test(e.text))) problems.push(`log (${e.source}): ${e.text} ${e.url || ""}`);
    }
  });
  await cmd("Page.enable");
  await cmd("Runtime.enable");
  // Every completion request's X-Laplace-Affinity (what a fleet's balancer routes on), as the
  // page hands it to fetch (recorded in the page, before its own script runs).
  await cmd("Page.addScriptToEvaluateOnNewDocument", { source: `(${recordAffinity.toString()})();` });
  await cmd("Log.enable");
  await viewport(900, 760, false);

  // 1. The page loads without the key and asks for it; with the key it shows the model.
  await load();
  await waitFor(`document.getElementById("status").textContent.includes("API key")`, "the page to ask for the API key", 10000);
  ok("the page loads without the key and asks for it");
  await typeInto("#api-key", KEY);
  await key("Tab", "Tab", 9);  // leaving the field commits it (a change event)
  await waitFor(`document.getElementById("model-name").textContent === "tiny"`, "the model's name", 10000);
  check(await evaluate(`sessionStorage.getItem("laplace.apiKey")`) === KEY, "the key is kept in session storage");

  // 2. Chat: type, Enter, streamed text arrives; Stop ends the stream mid-way.
  await evaluate(`(() => { const set = (id, v) => { document.getElementById(id).value = v; };
    set("temperature", "1"); set("max_tokens", "90000"); set("seed", "7");
    document.getElementById("ignore_eos").checked = true; })()`);
  await typeInto("#prompt", "Tell me about the quick brown fox.");
  await key("Enter", "Enter", 13, "\r");
  await waitFor(`document.querySelector("#transcript .msg.user .text")?.textContent === "Tell me about the quick brown fox."`,
                "the user's message", 5000);
  const t0 = Date.now();
  await waitFor(`(document.querySelector("#transcript .msg.bot .text")?.textContent.length || 0) > 40`,
                "streamed text to arrive", 60000);
  const streaming = await evaluate(`document.body.dataset.streaming === "1" && !document.getElementById("stop").disabled`);
  check(streaming, `streamed text arrives while the reply is still streaming (${Date.now() - t0} ms)`);
  await click("#stop");
  await waitFor(`document.querySelector("#transcript .msg.bot")?.dataset.done === "stopped"`, "the reply to stop", 10000);
  const len1 = await evaluate(`document.querySelector("#transcript .msg.bot .text").textContent.length`);
  await sleep(1500);
  const len2 = await evaluate(`document.querySelector("#transcript .msg.bot .text").textContent.length`);
  check(len1 === len2 && len1 > 40, `Stop ends the stream (${len1} characters, none after)`);
  // The server stopped the work too: the browser closed the stream, the server cancelled it.
  await waitFor(`fetch("/metrics", {headers: {Authorization: "Bearer " + sessionStorage.getItem("laplace.apiKey")}})
    .then((r) => r.text()).then((t) => /^laplace_requests_running 0$/m.test(t) && /^laplace_client_disconnects_total [1-9]/m.test(t))`,
                "the server to cancel the stopped request", 10000);
  ok("the server cancelled the stopped request (/metrics)");
  const stats = await evaluate(`document.querySelector("#transcript .msg.bot .stats").textContent`);
  check(/^~\d+ tokens · TTFT [\d.]+ m?s · [\d.,]+ tok\/s · stopped$/.test(stats), `the reply shows tokens, TTFT and tok/s: "${stats}"`);
  check(await evaluate(`!document.getElementById("send").disabled && !document.getElementById("regenerate").disabled`),
        "Send and Regenerate are enabled again");

  // 3. Regenerate replaces the reply (a short one this time).
  await evaluate(`document.getElementById("max_tokens").value = "12"`);
  await click("#regenerate");
  await waitFor(`document.querySelector("#transcript .msg.bot")?.dataset.done === "done"`, "the regenerated reply", 30000);
  check(await evaluate(`document.querySelectorAll("#transcript .msg.bot").length === 1 &&
    /^12 tokens/.test(document.querySelector("#transcript .msg.bot .stats").textContent)`), "Regenerate replaces the reply");
  await screenshot("ui-chat.png");

  // 4. Completion mode; markup in the prompt is shown as text, never run.
  await click('input[name="mode"][value="completion"]');
  const markup = `<img src=x onerror="window.pwned=1"><b>bold</b>`;
  await typeInto("#prompt", markup);
  await key("Enter", "Enter", 13, "\r");
  await waitFor(`document.querySelector("#transcript .msg.bot")?.dataset.done === "done"`, "the completion", 30000);
  check(await evaluate(`document.querySelector("#transcript .msg.bot .text").textContent.startsWith(${JSON.stringify(markup)}) &&
    !document.querySelector("#transcript img, #transcript b") && window.pwned === undefined`),
        "completion mode: the raw prompt and its continuation, markup shown as text");
  await click('input[name="mode"][value="chat"]');

  // 5. The server view, reached with the keyboard (arrow keys move between tabs), while a
  // long reply streams: live numbers, percentiles and the charts moving.
  await evaluate(`document.getElementById("max_tokens").value = "90000"`);
  await evaluate(`document.getElementById("prompt").value = ""`);
  await typeInto("#prompt", "Once upon a time");
  await key("Enter", "Enter", 13, "\r");
  await waitFor(`document.body.dataset.streaming === "1"`, "the long reply to start", 10000);
  await evaluate(`document.getElementById("tab-chat").focus()`);
  await key("ArrowRight", "ArrowRight", 39);
  check(await evaluate(`!document.getElementById("view-server").hidden && document.activeElement.id === "tab-server"`),
        "ArrowRight on the tabs opens the server view");
  await waitFor(`document.querySelector('[data-metric="running"] .value')?.textContent === "1"`, "one live sequence", 10000);
  await waitFor(`Number(document.querySelector('[data-metric="tps"] .value')?.textContent.replace(/,/g, "")) > 0`,
                "a tokens/s rate", 10000);
  await waitFor(`/ms|s$/.test(document.querySelector("#latency tbody tr td")?.textContent || "")`, "a TTFT percentile", 10000);
  const ttft = await evaluate(`document.querySelector("#latency tbody tr").textContent`);
  check(/^Time to first token/.test(ttft), `the server view shows live numbers and percentiles ("${ttft}")`);
  await sleep(6000);  // a few seconds of samples for the charts
  await evaluate(`document.activeElement.blur()`);
  await screenshot("ui-metrics.png");
  await click("#tab-chat");
  await evaluate(`document.getElementById("prompt").focus()`);
  await key("Escape", "Escape", 27);
  await waitFor(`document.querySelector("#transcript .msg.bot:last-child")?.dataset.done === "stopped"`, "Escape to stop the long reply", 10000);
  ok("Escape in the message box stops a reply");

  // 6. Sessions: create, fork, save, delete, restore.
  await click("#tab-sessions");
  await typeInto("#new-session-name", "demo");
  await typeInto("#new-session-prompt", "the quick brown fox");
  await click('#session-create button[type="submit"]');
  const row = (n) => `[...document.querySelectorAll("#sessions tbody th")].some((t) => t.textContent === ${JSON.stringify(n)})`;
  await waitFor(row("demo"), "the new session in the list", 15000);
  await typeInto('#sessions tbody tr input[aria-label$="demo"]', "demo-fork");
  await click('#sessions tbody button[aria-label="Fork session demo"]');
  await waitFor(row("demo-fork"), "the fork in the list", 10000);
  await click('#sessions tbody button[aria-label="Save session demo"]');
  await waitFor(`document.getElementById("status").textContent === "save demo: done"`, "the save", 10000);
  await click('#sessions tbody button[aria-label="Delete session demo"]');
  await waitFor(`!(${row("demo")})`, "the deleted session to leave the list", 10000);
  await typeInto("#restore-name", "demo");
  await click('#session-restore button[type="submit"]');
  await waitFor(row("demo"), "the restored session in the list", 10000);
  check(true, "sessions: create, fork, save, delete and restore from the page");
  await typeInto("#new-session-name", "no spaces allowed");
  await click('#session-create button[type="submit"]');
  await waitFor(`/^create no spaces allowed: 400: /.test(document.getElementById("status").textContent)`,
                "the server's error for a bad name", 10000);
  check(await evaluate(`document.getElementById("status").classList.contains("bad")`), "an error answer is shown as one");
  await evaluate(`document.getElementById("new-session-name").value = ""`);
  // A session continued from the chat.
  await click('#sessions tbody button[aria-label="Use in chat session demo-fork"]');
  check(await evaluate(`!document.getElementById("view-chat").hidden && document.getElementById("session").value === "demo-fork"`),
        "Use in chat: the chat view, starting from the session");
  await evaluate(`document.getElementById("max_tokens").value = "5"; document.getElementById("prompt").value = ""`);
  await typeInto("#prompt", "and then");
  await key("Enter", "Enter", 13, "\r");
  await waitFor(`document.querySelector("#transcript .msg.bot:last-child")?.dataset.done === "done"`, "the reply from the session", 30000);
  check(/^5 tokens/.test(await evaluate(`document.querySelector("#transcript .msg.bot:last-child .stats").textContent`)),
        "a chat reply continues a named session");
  await evaluate(`document.getElementById("session").value = ""`);

  // Affinity: one key for the turns of a conversation, a prompt's hash for a completion, the
  // session's name when a request continues one.
  const affinity = await evaluate("window.__laplaceAffinity");
  const chatKeys = affinity.filter((a) => a.chat && !a.session).map((a) => a.key);
  // (the first reply and its regeneration: one conversation; a cleared chat starts another)
  check(chatKeys.length >= 2 && chatKeys.every((k) => /^c-[0-9a-f]{16}$/.test(k)) && chatKeys[1] === chatKeys[0],
        `a conversation's requests carry one X-Laplace-Affinity key (${chatKeys.join(", ")})`);
  check(affinity.some((a) => !a.chat && /^p-[0-9a-f]{8}$/.test(a.key)), "a completion's key is its prompt's hash");
  check(affinity.some((a) => a.session === "demo-fork" && a.key === "demo-fork"), "a session's requests route by its name");

  // 7. A phone-sized window: every view fits its width.
  await viewport(390, 844, true);
  await load();
  await waitFor(`document.getElementById("model-name").textContent === "tiny"`, "the page on a phone", 10000);
  await noHorizontalOverflow("chat view on a phone");
  await click("#tab-server");
  await waitFor(`document.querySelectorAll("#cards .card").length > 5`, "the cards on a phone", 10000);
  await noHorizontalOverflow("server view on a phone");
  await screenshot("ui-phone.png");
  await click("#tab-sessions");
  await waitFor(row("demo-fork"), "the sessions on a phone", 10000);
  await noHorizontalOverflow("sessions view on a phone");

  check(problems.length === 0, `no page exception, console error or policy violation${problems.length ? ": " + problems.join("; ") : ""}`);
}

let finished = false;
const watchdog = setTimeout(() => { console.error("FAIL: the whole test took over 240 s"); cleanup(1); }, 240000);
function cleanup(code) {
  clearTimeout(watchdog);
  chrome.kill("SIGKILL");
  try { rmSync(profile, { recursive: true, force: true }); } catch (_) { /* best effort */ }
  process.exit(code);
}
chrome.on("exit", (c) => { if (!finished) { console.error(`FAIL: chromium exited (${c}): ${chromeErr}`); cleanup(1); } });
main().then(() => {
  console.log(`${passed} passed, 0 failed, ${((Date.now() - started) / 1000).toFixed(1)} s`);
  finished = true;  // the browser is killed next: its exit is expected
  cleanup(0);
}, async (e) => {
  finished = true;
  console.error(`FAIL: ${e.message}`);
  if (problems.length) console.error("page problems: " + problems.join("; "));
  try {  // what the page showed, to tell why
    const shown = await evaluate(`document.getElementById("status").textContent + " | " +
      document.getElementById("transcript").textContent.slice(0, 600)`);
    console.error("page: " + shown);
  } catch (_) { /* the page is gone */ }
  cleanup(1);
});
