// Runs the official Node.js Pub/Sub client, unchanged, against the server named by PUBSUB_EMULATOR_HOST:
// create a topic and an ordered subscription, publish ordered messages with attributes, receive them
// through the streaming `subscription.on('message')` API, ack them, nack one message and see it come
// back, then delete everything. Prints one JSON summary line on stdout; exits 0 only if every check held.
//
// Environment: PUBSUB_EMULATOR_HOST (required), INTEROP_PROJECT, INTEROP_TOPIC, INTEROP_SUBSCRIPTION,
// INTEROP_WITNESS_SUBSCRIPTION (a second subscription, created and never pulled),
// INTEROP_MESSAGES (ordered messages to publish, default 5), INTEROP_TIMEOUT_MS (default 45000).
import {createRequire} from 'node:module';
import {PubSub} from '@google-cloud/pubsub';
import {fail, run} from './harness.mjs';

const require = createRequire(import.meta.url);
const clientVersion = require('@google-cloud/pubsub/package.json').version;

const emulatorHost = process.env.PUBSUB_EMULATOR_HOST;
const suffix = `${process.pid}-${Date.now()}`;
const projectId = process.env.INTEROP_PROJECT || 'hedgepub-interop';
const topicId = process.env.INTEROP_TOPIC || `node-topic-${suffix}`;
const subscriptionId = process.env.INTEROP_SUBSCRIPTION || `node-sub-${suffix}`;
const witnessId = process.env.INTEROP_WITNESS_SUBSCRIPTION || '';
const orderedCount = Number(process.env.INTEROP_MESSAGES || 5);
const timeoutMs = Number(process.env.INTEROP_TIMEOUT_MS || 45000);
const orderingKey = 'interop-key';
// After the last ack, how long to watch for a delivery that should not come.
const quietMs = 500;

function check(condition, message) {
  if (!condition) fail(message);
}

function deferred() {
  let resolve;
  const promise = new Promise(r => (resolve = r));
  return {promise, resolve};
}

const sleep = ms => new Promise(r => setTimeout(r, ms));

async function main() {
  check(emulatorHost, 'PUBSUB_EMULATOR_HOST is not set');
  check(Number.isInteger(orderedCount) && orderedCount > 0, 'INTEROP_MESSAGES must be a positive integer');
  const pubsub = new PubSub({projectId});

  const [topic] = await pubsub.createTopic(topicId);
  check(topic.name === `projects/${projectId}/topics/${topicId}`, `unexpected topic name ${topic.name}`);
  // A second subscription that nobody pulls keeps every message on the server (a message goes with
  // its last reference), so the test can compare what the server stored with what was sent.
  if (witnessId) await topic.createSubscription(witnessId);
  const [subscription] = await topic.createSubscription(subscriptionId, {
    enableMessageOrdering: true,
    ackDeadlineSeconds: 10,
  });
  const [metadata] = await subscription.getMetadata();
  check(metadata.enableMessageOrdering === true, 'subscription does not report enableMessageOrdering');
  check(metadata.topic === topic.name, `subscription is attached to ${metadata.topic}`);

  const received = [];
  const deliveries = new Map();
  const unexpected = [];
  let nackId = null;
  let acked = 0;
  const allDone = deferred();
  const expected = orderedCount + 1;

  subscription.on('error', error => fail(`subscription error: ${error.code} ${error.message}`));
  subscription.on('message', message => {
    const count = (deliveries.get(message.id) || 0) + 1;
    deliveries.set(message.id, count);
    const kind = message.attributes.kind;
    if (kind === 'ordered') {
      if (count > 1) unexpected.push({id: message.id, kind, delivery: count});
      received.push({
        id: message.id,
        data: message.data.toString('utf8'),
        attributes: {...message.attributes},
        orderingKey: message.orderingKey,
        publishTime: message.publishTime.toISOString(),
      });
      message.ack();
      acked += 1;
    } else if (kind === 'nack') {
      nackId = message.id;
      if (count === 1) {
        // The first delivery is refused; the server must hand the same message out again.
        message.nack();
        return;
      }
      if (count > 2) unexpected.push({id: message.id, kind, delivery: count});
      message.ack();
      acked += 1;
    } else {
      unexpected.push({id: message.id, kind: kind ?? null, delivery: count});
      message.ack();
    }
    if (acked === expected) allDone.resolve();
  });

  // Two rounds, so order must hold across Publish calls as well as within one batch.
  const orderedTopic = pubsub.topic(topicId, {messageOrdering: true});
  const orderedIds = [];
  const half = Math.ceil(orderedCount / 2);
  for (const [start, end] of [
    [0, half],
    [half, orderedCount],
  ]) {
    const round = [];
    for (let i = start; i < end; i++) {
      round.push(
        orderedTopic.publishMessage({
          data: Buffer.from(`ordered-${i}`),
          attributes: {kind: 'ordered', seq: String(i), origin: 'node'},
          orderingKey,
        })
      );
    }
    orderedIds.push(...(await Promise.all(round)));
  }
  const nackPublishedId = await topic.publishMessage({
    data: Buffer.from('nack-me'),
    attributes: {kind: 'nack', origin: 'node'},
  });
  const publishedIds = [...orderedIds, nackPublishedId];
  check(new Set(publishedIds).size === publishedIds.length, 'publish returned duplicate message IDs');

  await allDone.promise;
  await sleep(quietMs);
  await subscription.close();

  check(unexpected.length === 0, `unexpected deliveries: ${JSON.stringify(unexpected)}`);
  check(received.length === orderedCount, `received ${received.length} of ${orderedCount} ordered messages`);
  received.forEach((message, i) => {
    check(message.id === orderedIds[i], `ordered message ${i} is ${message.id}, published as ${orderedIds[i]}`);
    check(message.data === `ordered-${i}`, `ordered message ${i} has data ${JSON.stringify(message.data)}`);
    check(message.attributes.seq === String(i), `ordered message ${i} has seq ${message.attributes.seq}`);
    check(message.attributes.origin === 'node', `ordered message ${i} lost its origin attribute`);
    check(message.orderingKey === orderingKey, `ordered message ${i} has ordering key ${message.orderingKey}`);
  });
  check(nackId === nackPublishedId, `nacked message ${nackId} is not the one published (${nackPublishedId})`);
  check(deliveries.get(nackId) === 2, `nacked message delivered ${deliveries.get(nackId)} times, not 2`);

  await subscription.delete();
  await topic.delete();
  const [topicExists] = await topic.exists();
  const [subscriptionExists] = await subscription.exists();
  check(!topicExists, 'topic still exists after delete');
  check(!subscriptionExists, 'subscription still exists after delete');
  await pubsub.close();

  return {
    ok: true,
    client: '@google-cloud/pubsub',
    clientVersion,
    node: process.version,
    project: projectId,
    topic: topic.name,
    subscription: subscription.name,
    published: publishedIds,
    received,
    orderOk: true,
    nack: {id: nackId, deliveries: deliveries.get(nackId)},
    deleted: true,
  };
}

run(main, timeoutMs);
