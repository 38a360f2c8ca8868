// sdk.mjs drives the official openai npm SDK against one OpenAI-compatible
// base URL and prints one JSON document: per request, what the SDK parsed,
// reduced to what a harness uses (text, tool calls, usage, finish reasons,
// the stream helpers' accumulated snapshots). The Go test runs it against
// the scripted model directly and through relay → gateway → model and
// compares the two documents.
//
// Usage: node sdk.mjs SDK_DIR BASE_URL
// SDK_DIR is the openai package directory (.tools/npm/node_modules/openai);
// $STASIS_OPENAI_SDK stands in for it when the argument is empty.

import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const sdkDir = process.argv[2] || process.env.STASIS_OPENAI_SDK;
const baseURL = process.argv[3];
if (!sdkDir || !baseURL) {
  console.error('usage: node sdk.mjs SDK_DIR BASE_URL');
  process.exit(2);
}
const { default: OpenAI } = await import(pathToFileURL(join(sdkDir, 'index.mjs')).href);
const version = JSON.parse(readFileSync(join(sdkDir, 'package.json'), 'utf8')).version;

// Every HTTP request the SDK makes, counted: the test checks the ledger
// holds one entry per model call made through the relay.
let httpCalls = 0;
const countingFetch = (url, init) => {
  httpCalls++;
  return fetch(url, init);
};

// A short timeout and no retries: a failure shows as a failure.
const client = new OpenAI({ apiKey: 'sk-stasis-test', baseURL, timeout: 10_000, maxRetries: 0, fetch: countingFetch });

const MODEL = 'stasis-scripted';
const PLAIN = [{ role: 'user', content: 'PLAIN: say hello.' }];
const ASK = [
  { role: 'system', content: 'You answer weather questions with the tools.' },
  { role: 'user', content: 'What is the weather in Paris and Lyon, and the time?' },
];
const chatTools = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'The weather in a city.',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    },
  },
  {
    type: 'function',
    function: {
      name: 'get_time',
      description: 'The time in a time zone.',
      parameters: { type: 'object', properties: { tz: { type: 'string' } }, required: ['tz'] },
    },
  },
];
const respTools = chatTools.map((t) => ({ type: 'function', name: t.function.name, description: t.function.description, parameters: t.function.parameters, strict: false }));

// The tool's answer to a call, fed back as the tool result.
const toolResult = (name, args) => JSON.stringify({ tool: name, args: JSON.parse(args), result: name === 'get_time' ? '12:00' : 'sunny, 21 °C' });

const logprobs = (lp) => (lp == null ? lp : { content: lp.content?.map((e) => ({ token: e.token, logprob: e.logprob, bytes: e.bytes })) ?? lp.content });

// chatCompletion reduces a chat.completion (parsed or assembled by a helper).
function chatCompletion(c) {
  return {
    id: c.id,
    object: c.object,
    created: c.created,
    model: c.model,
    system_fingerprint: c.system_fingerprint,
    usage: c.usage ?? null,
    prompt_token_ids: c.prompt_token_ids,
    choices: c.choices.map((ch) => ({
      index: ch.index,
      finish_reason: ch.finish_reason,
      role: ch.message.role,
      content: ch.message.content,
      refusal: ch.message.refusal,
      tool_calls: ch.message.tool_calls?.map((tc) => ({ id: tc.id, type: tc.type, name: tc.function.name, arguments: tc.function.arguments })),
      logprobs: logprobs(ch.logprobs),
      token_ids: ch.token_ids,
    })),
  };
}

// chatStreamRaw iterates the raw chunks and accumulates them by hand.
async function chatStreamRaw(params) {
  const stream = await client.chat.completions.create({ ...params, stream: true });
  const distinct = { id: new Set(), object: new Set(), created: new Set(), model: new Set(), system_fingerprint: new Set() };
  const acc = { role: null, content: '', tool_calls: [], finish_reasons: [], usage: [], usage_chunk_choices: [], prompt_token_ids: null, token_ids: [], logprobs: [] };
  for await (const chunk of stream) {
    for (const k of Object.keys(distinct)) if (chunk[k] !== undefined) distinct[k].add(chunk[k]);
    if (chunk.usage) {
      acc.usage.push(chunk.usage);
      acc.usage_chunk_choices.push(chunk.choices.length);
    }
    if (chunk.prompt_token_ids) acc.prompt_token_ids = (acc.prompt_token_ids ?? []).concat(chunk.prompt_token_ids);
    for (const ch of chunk.choices) {
      const d = ch.delta ?? {};
      if (d.role) acc.role = d.role;
      if (typeof d.content === 'string') acc.content += d.content;
      for (const tc of d.tool_calls ?? []) {
        const cur = (acc.tool_calls[tc.index] ??= { ids: [], type: null, name: '', arguments: '' });
        if (tc.id) cur.ids.push(tc.id);
        if (tc.type) cur.type = tc.type;
        if (tc.function?.name) cur.name += tc.function.name;
        if (tc.function?.arguments) cur.arguments += tc.function.arguments;
      }
      if (ch.finish_reason != null) acc.finish_reasons.push(ch.finish_reason);
      if (ch.token_ids) acc.token_ids.push(...ch.token_ids);
      for (const e of ch.logprobs?.content ?? []) acc.logprobs.push({ token: e.token, logprob: e.logprob });
    }
  }
  const out = {};
  for (const [k, v] of Object.entries(distinct)) out[k] = [...v];
  return { ...out, ...acc };
}

// chatStreamHelper runs client.chat.completions.stream(): its final
// completion, the snapshot it accumulated, and what its events reported.
async function chatStreamHelper(params) {
  const s = client.chat.completions.stream({ ...params, stream_options: { include_usage: true } });
  const ev = { content_delta_snapshot: null, content_done: [], arguments_delta_snapshots: {}, arguments_done: [] };
  s.on('content.delta', (e) => { ev.content_delta_snapshot = e.snapshot; });
  s.on('content.done', (e) => { ev.content_done.push(e.content); });
  s.on('tool_calls.function.arguments.delta', (e) => { ev.arguments_delta_snapshots[e.index] = { name: e.name, snapshot: e.arguments }; });
  s.on('tool_calls.function.arguments.done', (e) => { ev.arguments_done.push({ index: e.index, name: e.name, arguments: e.arguments, parsed_arguments: e.parsed_arguments }); });
  const final = chatCompletion(await s.finalChatCompletion());
  // The helper does not accumulate fields it does not know, such as vLLM's
  // token_ids: each chunk's replace the last, so what it holds depends on
  // how the stream was chunked. The raw streams accumulate them instead.
  for (const ch of final.choices) delete ch.token_ids;
  return { final, events: ev };
}

// chatConversation plays the tool conversation to its end: each turn's
// tool calls are fed back with a tool result for each.
async function chatConversation(turn) {
  const messages = [...ASK];
  const turns = [];
  for (let i = 0; i < 4; i++) {
    const { record, message } = await turn(messages);
    turns.push(record);
    if (!message.tool_calls?.length) break;
    messages.push({ role: 'assistant', content: message.content, tool_calls: message.tool_calls.map((tc) => ({ id: tc.id, type: 'function', function: { name: tc.function.name, arguments: tc.function.arguments } })) });
    for (const tc of message.tool_calls) messages.push({ role: 'tool', tool_call_id: tc.id, content: toolResult(tc.function.name, tc.function.arguments) });
  }
  return turns;
}

// response reduces a Responses-API response object.
function response(r) {
  return {
    id: r.id,
    object: r.object,
    created_at: r.created_at,
    status: r.status,
    model: r.model,
    error: r.error,
    incomplete_details: r.incomplete_details,
    output_text: r.output_text,
    usage: r.usage ?? null,
    prompt_token_ids: r.prompt_token_ids,
    token_ids: r.token_ids,
    output: r.output.map(item),
  };
}

function item(it) {
  if (it.type === 'message') {
    return {
      type: it.type, id: it.id, status: it.status, role: it.role,
      content: it.content.map((p) => ({ type: p.type, text: p.text, annotations: p.annotations, logprobs: p.logprobs?.map((e) => ({ token: e.token, logprob: e.logprob })) })),
    };
  }
  if (it.type === 'function_call') return { type: it.type, id: it.id, call_id: it.call_id, name: it.name, arguments: it.arguments, status: it.status };
  return { type: it.type, id: it.id };
}

// responsesStreamRaw iterates the raw events. Event types are recorded in
// order with runs of one type collapsed: how many deltas a text or an
// argument string comes in is the sender's choice.
async function responsesStreamRaw(params) {
  const stream = await client.responses.create({ ...params, stream: true });
  const acc = { types: [], sequence_ok: true, created_event: null, added: [], text_deltas: {}, text_done: {}, arguments_deltas: {}, arguments_done: {}, done: [], completed: null };
  let seq = -1;
  for await (const e of stream) {
    if (acc.types[acc.types.length - 1] !== e.type) acc.types.push(e.type);
    if (!(e.sequence_number > seq)) acc.sequence_ok = false;
    seq = e.sequence_number;
    const key = `${e.output_index}/${e.content_index ?? 0}`;
    switch (e.type) {
      case 'response.created': acc.created_event = response(e.response); break;
      case 'response.output_item.added': acc.added.push({ output_index: e.output_index, item: item(e.item) }); break;
      case 'response.output_text.delta': acc.text_deltas[key] = (acc.text_deltas[key] ?? '') + e.delta; break;
      case 'response.output_text.done': acc.text_done[key] = e.text; break;
      case 'response.function_call_arguments.delta': acc.arguments_deltas[key] = (acc.arguments_deltas[key] ?? '') + e.delta; break;
      case 'response.function_call_arguments.done': acc.arguments_done[key] = e.arguments; break;
      case 'response.output_item.done': acc.done.push({ output_index: e.output_index, item: item(e.item) }); break;
      case 'response.completed': acc.completed = response(e.response); break;
    }
  }
  return acc;
}

// responsesStreamHelper runs client.responses.stream(): finalResponse(),
// and the snapshots the helper accumulates and hands its delta events.
async function responsesStreamHelper(params) {
  const s = client.responses.stream(params);
  const ev = { text_delta_snapshots: {}, arguments_delta_snapshots: {}, text_done: {} };
  s.on('response.output_text.delta', (e) => { ev.text_delta_snapshots[`${e.output_index}/${e.content_index}`] = e.snapshot; });
  s.on('response.output_text.done', (e) => { ev.text_done[`${e.output_index}/${e.content_index}`] = e.text; });
  s.on('response.function_call_arguments.delta', (e) => { ev.arguments_delta_snapshots[`${e.output_index}`] = e.snapshot; });
  const final = await s.finalResponse();
  return { record: { final: response(final), events: ev }, output: final.output };
}

// responsesConversation plays the tool conversation to its end: the output
// items go back into the input, with a function_call_output per call.
async function responsesConversation(turn) {
  const input = ASK.map((m) => ({ type: 'message', role: m.role, content: m.content }));
  const turns = [];
  for (let i = 0; i < 4; i++) {
    const { record, output } = await turn(input);
    turns.push(record);
    const calls = output.filter((it) => it.type === 'function_call');
    if (calls.length === 0) break;
    for (const it of output) {
      if (it.type === 'message') input.push({ type: 'message', role: 'assistant', id: it.id, status: it.status, content: it.content.map((p) => ({ type: p.type, text: p.text, annotations: p.annotations })) });
      else input.push({ type: 'function_call', id: it.id, call_id: it.call_id, name: it.name, arguments: it.arguments, status: it.status });
    }
    for (const c of calls) input.push({ type: 'function_call_output', call_id: c.call_id, output: toolResult(c.name, c.arguments) });
  }
  return turns;
}

const requests = {
  'chat.create': () => client.chat.completions.create({ model: MODEL, messages: PLAIN, logprobs: true }).then(chatCompletion),
  'chat.stream.raw.usage': () => chatStreamRaw({ model: MODEL, messages: PLAIN, stream_options: { include_usage: true } }),
  'chat.stream.raw': () => chatStreamRaw({ model: MODEL, messages: PLAIN }),
  'chat.stream.raw.tools': () => chatStreamRaw({ model: MODEL, messages: ASK, tools: chatTools, stream_options: { include_usage: true } }),
  'chat.stream.helper': () => chatStreamHelper({ model: MODEL, messages: PLAIN }),
  'chat.tools.create': () => chatConversation(async (messages) => {
    const c = await client.chat.completions.create({ model: MODEL, messages, tools: chatTools });
    return { record: chatCompletion(c), message: c.choices[0].message };
  }),
  'chat.tools.stream.helper': () => chatConversation(async (messages) => {
    const r = await chatStreamHelper({ model: MODEL, messages, tools: chatTools });
    const m = r.final.choices[0];
    return { record: r, message: { content: m.content, tool_calls: m.tool_calls?.map((tc) => ({ id: tc.id, function: { name: tc.name, arguments: tc.arguments } })) } };
  }),
  'responses.create': () => client.responses.create({ model: MODEL, input: 'PLAIN: say hello.' }).then(response),
  'responses.stream.raw': () => responsesStreamRaw({ model: MODEL, input: 'PLAIN: say hello.' }),
  'responses.stream.raw.tools': () => responsesStreamRaw({ model: MODEL, input: ASK.map((m) => ({ type: 'message', role: m.role, content: m.content })), tools: respTools }),
  'responses.stream.helper': () => responsesStreamHelper({ model: MODEL, input: 'PLAIN: say hello.' }).then((r) => r.record),
  'responses.tools.create': () => responsesConversation(async (input) => {
    const r = await client.responses.create({ model: MODEL, input, tools: respTools });
    return { record: response(r), output: r.output };
  }),
  'responses.tools.stream.helper': () => responsesConversation((input) => responsesStreamHelper({ model: MODEL, input, tools: respTools })),
};

const results = {};
for (const [name, run] of Object.entries(requests)) {
  try {
    results[name] = { ok: await run() };
  } catch (err) {
    results[name] = { error: `${err?.constructor?.name}: ${err?.message}` };
  }
}
process.stdout.write(JSON.stringify({ sdk_version: version, http_calls: httpCalls, results }, null, 1) + '\n');
