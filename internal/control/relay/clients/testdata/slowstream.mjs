// slowstream.mjs makes one streaming chat completion with the official
// openai npm SDK, with a request timeout shorter than the generation, and
// prints one JSON line: the text it streamed, or the error it got, and how
// long it took.
//
// Usage: node slowstream.mjs SDK_DIR BASE_URL TIMEOUT_MS

import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [sdkDir, baseURL, timeoutArg] = process.argv.slice(2);
if (!sdkDir || !baseURL || !timeoutArg) {
  console.error('usage: node slowstream.mjs SDK_DIR BASE_URL TIMEOUT_MS');
  process.exit(2);
}
const { default: OpenAI } = await import(pathToFileURL(join(sdkDir, 'index.mjs')).href);
const client = new OpenAI({ apiKey: 'sk-stasis-test', baseURL, timeout: Number(timeoutArg), maxRetries: 0 });
const t0 = Date.now();
const out = { text: '', chunks: 0, error: null, ms: 0 };
try {
  const stream = await client.chat.completions.create({
    model: 'stasis-scripted',
    stream: true,
    messages: [{ role: 'user', content: 'PLAIN: say hello slowly.' }],
  });
  for await (const chunk of stream) {
    out.chunks++;
    out.text += chunk.choices[0]?.delta?.content ?? '';
  }
} catch (e) {
  out.error = `${e.constructor.name}: ${e.message}`;
}
out.ms = Date.now() - t0;
console.log(JSON.stringify(out));
