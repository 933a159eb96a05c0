// The Vercel AI SDK's default OpenAI provider, unchanged, against `dgemma serve`: `openai(model)` speaks the
// Responses API with `store: true`, so a second turn and a tool step send earlier items as `item_reference`s.
//   node check.mjs http://127.0.0.1:PORT MODEL
// Prints one JSON line per check and exits non-zero on the first failure.
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText, stepCountIs, tool } from 'ai';
import { z } from 'zod';

const [base, modelName] = process.argv.slice(2);
if (!base || !modelName) {
  console.error('usage: node check.mjs BASE_URL MODEL');
  process.exit(2);
}
const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'unused' });
const model = openai(modelName);
const settings = { maxOutputTokens: 16, maxRetries: 0 };

function report(check, fields) {
  console.log(JSON.stringify({ check, ...fields }));
}

// 1. two turns: the second carries the first answer as an item reference
const first = await generateText({ model, prompt: 'Say hello.', ...settings });
const history = [{ role: 'user', content: 'Say hello.' }, ...first.response.messages];
const sent = JSON.stringify(history);
const second = await generateText({ model, messages: [...history, { role: 'user', content: 'Again.' }], ...settings });
report('second turn', { first: first.text, second: second.text, finish: second.finishReason,
                        references: (sent.match(/itemId/g) || []).length });

// 2. the same as a stream
const streamed = streamText({ model, messages: [...history, { role: 'user', content: 'Again.' }], ...settings });
let text = '';
for await (const part of streamed.textStream) text += part;
report('second turn streamed', { text, finish: await streamed.finishReason });

// 3. a two-step tool loop: step 1 must call the tool, step 2 answers from its result
const weather = tool({
  description: 'The weather in a city',
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => ({ city, temperature: 21 }),
});
const loop = await generateText({
  model, tools: { weather }, prompt: 'What is the weather in Paris?', ...settings, maxOutputTokens: 64,
  stopWhen: stepCountIs(2),
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' }),
});
const calls = loop.steps[0].toolCalls;
report('tool loop', { steps: loop.steps.length, calls: calls.map((c) => [c.toolName, c.input]),
                      results: loop.steps[0].toolResults.length, answer: loop.text, finish: loop.finishReason });
if (loop.steps.length !== 2 || calls.length < 1 || calls[0].toolName !== 'weather' ||
    typeof calls[0].input.city !== 'string') {
  console.error('the tool loop did not call the tool and answer in two steps');
  process.exit(1);
}
