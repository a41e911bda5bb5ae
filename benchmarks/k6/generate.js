// k6 cross-check of `python -m benchmarks`: the same closed loop against GatewayService/Generate.
// BENCH_VUS virtual users share BENCH_ITERATIONS iterations; each iteration streams one request from
// BENCH_PROMPTS (a JSON list of {prompt, max_tokens}) and records its end-to-end latency and TTFT.
// Run by benchmarks/k6check.py, which compares k6's request rate and latencies with ours.
import { Client, Stream } from 'k6/net/grpc';
import { Counter, Trend } from 'k6/metrics';
import exec from 'k6/execution';

const prompts = JSON.parse(open(__ENV.BENCH_PROMPTS));
const e2e = new Trend('grok_e2e_ms', true);
const ttft = new Trend('grok_ttft_ms', true);
// (end - first token) / (tokens - 1) per request: AIPerf's inter-token latency and vLLM's TPOT.
const tpot = new Trend('grok_tpot_ms', true);
const outputTokens = new Counter('grok_output_tokens');
const failed = new Counter('grok_failed');
// Send and end times (ms since the epoch): the tool's duration is first send to last end, as ours.
const sent = new Trend('grok_sent_at');
const ended = new Trend('grok_ended_at');
const client = new Client();

export const options = {
  scenarios: {
    closed_loop: {
      executor: 'shared-iterations',
      vus: Number(__ENV.BENCH_VUS),
      iterations: Number(__ENV.BENCH_ITERATIONS),
      maxDuration: '60m',
    },
  },
  summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(90)', 'p(99)', 'count'],
};

export default function () {
  if (exec.vu.iterationInScenario === 0) {
    client.connect(__ENV.BENCH_ADDRESS, { plaintext: true, reflect: true });
  }
  const item = prompts[exec.scenario.iterationInTest % prompts.length];
  const start = Date.now();
  sent.add(start);
  let first = 0;
  let tokens = 0;
  const stream = new Stream(client, 'grok.gateway.v1.GatewayService/Generate');
  stream.on('data', (reply) => {
    const n = reply.tokens ? reply.tokens.length : 0;
    if (n > 0 && first === 0) {
      first = Date.now();
    }
    tokens += n;
  });
  stream.on('error', () => failed.add(1));
  stream.on('end', () => {
    const end = Date.now();
    ended.add(end);
    e2e.add(end - start);
    if (first > 0) {
      ttft.add(first - start);
    }
    if (first > 0 && tokens > 1) {
      tpot.add((end - first) / (tokens - 1));
    }
    outputTokens.add(tokens);
  });
  stream.write({ prompt: item.prompt, sampling: { max_tokens: item.max_tokens, ignore_eos: true } });
  stream.end();
}

export function handleSummary(data) {
  return { [__ENV.BENCH_SUMMARY]: JSON.stringify(data) };
}
