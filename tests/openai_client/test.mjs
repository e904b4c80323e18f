// The official `openai` npm client against a running `laplace serve` (LAPLACE_URL,
// LAPLACE_MODEL, LAPLACE_API_KEY set by tests/server_clients.sh). Run: node --test.
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.LAPLACE_URL + "/v1",
  apiKey: process.env.LAPLACE_API_KEY,
  maxRetries: 0,
});
const model = process.env.LAPLACE_MODEL;

test("models.list names the served model", async () => {
  const list = await client.models.list();
  const ids = [];
  for await (const m of list) ids.push(m.id);
  assert.deepEqual(ids, [model]);
});

test("completions: greedy is deterministic and counts usage", async () => {
  const a = await client.completions.create({ model, prompt: "The meaning of life is", max_tokens: 12, temperature: 0 });
  const b = await client.completions.create({ model, prompt: "The meaning of life is", max_tokens: 12, temperature: 0 });
  assert.equal(a.object, "text_completion");
  assert.equal(a.choices.length, 1);
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.equal(a.usage.completion_tokens, 12);
  assert.ok(a.usage.prompt_tokens > 0);
  assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + a.usage.completion_tokens);
  assert.equal(a.choices[0].finish_reason, "length");
});

test("completions: streaming concatenates to the non-streamed text, with usage", async () => {
  const full = await client.completions.create({ model, prompt: "A fortune", max_tokens: 16, temperature: 0 });
  const stream = await client.completions.create({
    model, prompt: "A fortune", max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = "", usage = null, finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, full.choices[0].text);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 16);
});

test("chat: streamed and non-streamed replies agree; logprobs present", async () => {
  const messages = [{ role: "system", content: "Be brief." }, { role: "user", content: "Tell me a joke" }];
  const full = await client.chat.completions.create({ model, messages, max_tokens: 10, temperature: 0, logprobs: true, top_logprobs: 3 });
  assert.equal(full.object, "chat.completion");
  assert.equal(full.choices[0].message.role, "assistant");
  const lp = full.choices[0].logprobs.content;
  assert.ok(lp.length > 0);
  for (const e of lp) {
    assert.ok(e.logprob <= 0);
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.top_logprobs[0].logprob >= e.logprob - 1e-6);  // greedy picks the best
  }
  const stream = await client.chat.completions.create({ model, messages, max_tokens: 10, temperature: 0, stream: true });
  let text = "";
  for await (const chunk of stream) for (const c of chunk.choices) text += c.delta.content ?? "";
  assert.equal(text, full.choices[0].message.content);
});

test("n > 1 with a seed: reproducible choices", async () => {
  const req = { model, prompt: "Q: Why", max_tokens: 8, temperature: 1.0, seed: 7, n: 3 };
  const a = await client.completions.create(req);
  const b = await client.completions.create(req);
  assert.equal(a.choices.length, 3);
  assert.deepEqual(a.choices.map((c) => c.text), b.choices.map((c) => c.text));
});

test("errors come back as OpenAI errors", async () => {
  await assert.rejects(
    client.completions.create({ model, prompt: "x", max_tokens: -5 }),
    (e) => e.status === 400 && e.error?.param === "max_tokens");
  await assert.rejects(
    client.completions.create({ model: "no-such-model", prompt: "x" }),
    (e) => e.status === 404);
  const bad = new OpenAI({ baseURL: process.env.LAPLACE_URL + "/v1", apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);
});

test("stop strings end the text before them", async () => {
  const free = await client.completions.create({ model, prompt: "The", max_tokens: 24, temperature: 0 });
  const text = free.choices[0].text;
  // Stop at the second character of the free-running text: it must end just before it.
  const stop = text.slice(2, 4);
  if (stop.length < 2) return;
  const cut = await client.completions.create({ model, prompt: "The", max_tokens: 24, temperature: 0, stop: [stop] });
  assert.equal(cut.choices[0].text, text.slice(0, text.indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, "stop");
});
