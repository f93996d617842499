// Ordered delivery through the official Node.js client, unchanged, against the server named by
// PUBSUB_EMULATOR_HOST, in the manner of the client's own system test "ordered messages should pass the
// acceptance tests": publish ORDERED_MESSAGES messages spread over ORDERED_KEYS ordering keys, receive them
// on an ordered subscription through `subscription.on('message')` (several streams, as the client opens
// by default), ack each, and check that no key ever goes out of order: a message's first delivery comes
// only after every earlier message of its key was delivered. With ORDERED_NACK_EVERY
// = n > 0, the first delivery of every n-th message is nacked, so redeliveries are part of the run.
// Prints one JSON line: ok, the drain time (first publish answered .. last message acked once) and counts.
import {PubSub} from '@google-cloud/pubsub';
import {fail, run} from './harness.mjs';

const projectId = process.env.INTEROP_PROJECT || 'hedgepub-ordered';
const suffix = `${process.pid}-${Date.now()}`;
const total = Number(process.env.ORDERED_MESSAGES || 300);
const keys = Number(process.env.ORDERED_KEYS || 1);
const nackEvery = Number(process.env.ORDERED_NACK_EVERY || 0);
const timeoutMs = Number(process.env.INTEROP_TIMEOUT_MS || 120000);

async function main() {
  if (!process.env.PUBSUB_EMULATOR_HOST) fail('PUBSUB_EMULATOR_HOST is not set');
  const pubsub = new PubSub({projectId});
  const [topic] = await pubsub.createTopic(`ordered-${suffix}`);
  const [subscription] = await topic.createSubscription(`ordered-sub-${suffix}`, {
    enableMessageOrdering: true,
    ackDeadlineSeconds: 60,
  });

  const delivered = new Set(); // "key/index" delivered at least once
  const acked = new Set();
  const nackedOnce = new Set();
  let deliveries = 0;
  let done;
  const allAcked = new Promise(resolve => (done = resolve));
  subscription.on('error', error => fail(`subscription error: ${error.code} ${error.message}`));
  subscription.on('message', message => {
    deliveries += 1;
    const key = message.orderingKey;
    const index = Number(message.attributes.index);
    const id = `${key}/${index}`;
    if (!delivered.has(id)) {
      // A message's first delivery comes only after every earlier message of its key was delivered.
      if (index > 0 && !delivered.has(`${key}/${index - 1}`)) {
        fail(`key ${key}: message ${index} delivered before message ${index - 1} (order broken)`);
      }
      delivered.add(id);
    }
    if (nackEvery > 0 && index % nackEvery === nackEvery - 1 && !nackedOnce.has(id)) {
      nackedOnce.add(id);
      message.nack();
      return;
    }
    message.ack();
    acked.add(id);
    if (acked.size === total) done();
  });

  const orderedTopic = pubsub.topic(topic.name, {
    messageOrdering: true,
    batching: {maxMessages: 100, maxMilliseconds: 10},
  });
  const started = Date.now();
  const publishes = [];
  for (let i = 0; i < total; i++) {
    const key = `key-${i % keys}`;
    const index = Math.floor(i / keys);
    publishes.push(
      orderedTopic.publishMessage({data: Buffer.from(`${key}:${index}`), attributes: {index: String(index)}, orderingKey: key})
    );
  }
  await Promise.all(publishes);
  await allAcked;
  const drainMs = Date.now() - started;
  await subscription.close();
  await subscription.delete();
  await topic.delete();
  await pubsub.close();
  return {ok: true, total, keys, deliveries, nacked: nackedOnce.size, drainMs};
}

run(main, timeoutMs);
