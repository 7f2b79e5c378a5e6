// Vercel's `ai` SDK (its default `openai(...)` model speaks the Responses API) running a
// two-tool loop against the gateway; prints one JSON line: ok, text, steps, seconds, error.
// Usage: node ai_sdk_loop.mjs BASE_URL KEY MODEL '{"X-Policy": "two"}'
import { generateText, tool, stepCountIs, jsonSchema } from 'ai';
import { createOpenAI } from '@ai-sdk/openai';

const [url, key, model, headersJson] = process.argv.slice(2);
const openai = createOpenAI({ baseURL: url + '/v1', apiKey: key, headers: JSON.parse(headersJson || '{}') });
const tools = {
  list_files: tool({ description: 'List the files in the folder.', inputSchema: jsonSchema({ type: 'object', properties: {} }),
                     execute: async () => 'errors.log\nnotes.txt' }),
  read_file: tool({ description: 'Read one file of the folder.',
                    inputSchema: jsonSchema({ type: 'object', properties: { path: { type: 'string' } }, required: ['path'] }),
                    execute: async () => '12:00:03 worker 7 timed out after 30000 ms' }),
};
const started = Date.now();
try {
  const r = await generateText({ model: openai(model), prompt: 'Which file mentions a timeout?', tools, stopWhen: stepCountIs(6) });
  console.log(JSON.stringify({ ok: true, text: r.text, steps: r.steps.length, seconds: (Date.now() - started) / 1000 }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, error: e.name, seconds: (Date.now() - started) / 1000 }));
}
