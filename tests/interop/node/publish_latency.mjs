// Publish latency of the official Node.js client, unchanged, against the endpoint PUBSUB_EMULATOR_HOST
// names (the local server, or hedgepub proxy in front of it): LATENCY_WARM_UP publishes one after another,
// then LATENCY_MESSAGES publishes at LATENCY_RATE per second, each in a request of its own (batching of one
// message), each timed from publishMessage() to its message ID. benchmarks/proxy.py runs it.
// Prints one JSON line: ok, and each timed publish's latency in milliseconds, in order.
import {PubSub} from '@google-cloud/pubsub';
import {performance} from 'node:perf_hooks';
import {run} from './harness.mjs';

const projectId = process.env.INTEROP_PROJECT || 'hedgepub-latency';
const suffix = `${process.pid}-${Date.now()}`;
const count = Number(process.env.LATENCY_MESSAGES || 1000);
const rate = Number(process.env.LATENCY_RATE || 100);
const warmUp = Number(process.env.LATENCY_WARM_UP || 100);
const timeoutMs = Number(process.env.INTEROP_TIMEOUT_MS || 600000);

async function main() {
  const pubsub = new PubSub({projectId});
  const [created] = await pubsub.createTopic(`latency-${suffix}`);
  const topic = pubsub.topic(created.name, {batching: {maxMessages: 1, maxMilliseconds: 1}});
  for (let i = 0; i < warmUp; i++) {
    await topic.publishMessage({data: Buffer.from(`warm-up ${i}`)});
  }
  const latencies = new Array(count);
  const pending = [];
  const started = performance.now();
  for (let i = 0; i < count; i++) {
    const wait = started + (i * 1000) / rate - performance.now();
    if (wait > 0) await new Promise(resolve => setTimeout(resolve, wait));
    const sent = performance.now();
    pending.push(
      topic.publishMessage({data: Buffer.from(`m${i}`)}).then(() => {
        latencies[i] = performance.now() - sent;
      })
    );
  }
  await Promise.all(pending);
  await created.delete();
  await pubsub.close();
  return {ok: true, count, latenciesMs: latencies};
}

run(main, timeoutMs);
