// The Restate peer's services: the same job as benches/dbos_relay.py, done the Restate way.
//
// Restate's Kafka ingress turns each action message into one invocation of `Relay/handle`
// (deduplicated by topic, partition and offset). The handler forwards to the Virtual Object
// `Effect` keyed by the action's idempotency key: Restate runs one invocation per object key at a
// time, and the object keeps the first result in its state, so a repeat of the key (a different
// message) gets that result back and the downstream is called once. The call and the outcome's
// produce each run inside `ctx.run`, so they are journaled and a retried invocation does not
// repeat them once their result is durable.
//
// Run by benches/restate/launch.mjs as `node service.mjs SPEC_JSON`, SPEC_JSON being
// {"brokers", "outcomes", "url", "port"}; it prints "service listening on PORT" when it serves.

import { resolve } from "node:path";
import { fileURLToPath } from "node:url";

import * as restate from "@restatedev/restate-sdk";
import { Kafka, logLevel, Partitioners } from "kafkajs";

// The SDK calls Promise.withResolvers (Node 22) though it declares no engine; Node 20 lacks it.
if (!Promise.withResolvers) {
  Promise.withResolvers = function () {
    /** @type {any} */ let onResolve, onReject;
    const promise = new this((res, rej) => ((onResolve = res), (onReject = rej)));
    return { promise, resolve: onResolve, reject: onReject };
  };
}

/**
 * @typedef {{ run_id: string, tool: string, business_id?: string, args: unknown }} ActionData
 * @typedef {{ id: string, data: ActionData }} ActionEvent
 * @typedef {{ result: unknown, duplicate: boolean }} Performed
 */

/** Sends outcomes through one idempotent producer. */
class Outbox {
  /** @param {import("kafkajs").Producer} producer @param {string} topic */
  constructor(producer, topic) {
    this.producer = producer;
    this.topic = topic;
    /** @type {{ message: import("kafkajs").Message, done: (e?: unknown) => void }[]} */
    this.queue = [];
    this.sending = false;
  }

  /**
   * Resolves once the broker has acknowledged the message (acks = all).
   *
   * kafkajs's idempotent producer has one request in flight per broker and does not linger, so
   * one send per outcome would serialise every handler behind one round trip each; instead the
   * outcomes that arrive while a request is in flight go out together in the next one.
   *
   * @param {string} key @param {object} value
   * @returns {Promise<void>}
   */
  send(key, value) {
    return new Promise((resolve, reject) => {
      const message = { key, value: JSON.stringify(value) };
      this.queue.push({ message, done: (e) => (e ? reject(e) : resolve()) });
      this.#drain();
    });
  }

  async #drain() {
    if (this.sending) return;
    this.sending = true;
    while (this.queue.length > 0) {
      const batch = this.queue.splice(0, this.queue.length);
      try {
        await this.producer.send({ topic: this.topic, acks: -1, messages: batch.map((b) => b.message) });
        for (const b of batch) b.done();
      } catch (e) {
        for (const b of batch) b.done(e);
      }
    }
    this.sending = false;
  }
}

/**
 * The downstream call: POST args with the key as Idempotency-Key.
 *
 * @param {string} url @param {string} key @param {unknown} args
 */
async function call(url, key, args) {
  const r = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", "idempotency-key": key },
    body: JSON.stringify(args),
  });
  // A failure is thrown, so Restate retries the step.
  if (!r.ok) throw new Error(`downstream answered ${r.status}`);
  return r.json();
}

/**
 * @param {{ url: string, outbox: Outbox }} deps
 */
export function services({ url, outbox }) {
  const effect = restate.object({
    name: "Effect",
    handlers: {
      /**
       * Exclusive per key: the first invocation calls the downstream and stores the result;
       * every later one returns it.
       *
       * @param {restate.ObjectContext} ctx @param {unknown} args
       * @returns {Promise<Performed>}
       */
      perform: async (ctx, args) => {
        /** @type {{ result: unknown } | null} */
        const stored = await ctx.get("performed");
        if (stored !== null) return { result: stored.result, duplicate: true };
        const result = await ctx.run("call", () => call(url, ctx.key, args));
        ctx.set("performed", { result });
        return { result, duplicate: false };
      },
    },
  });

  const relay = restate.service({
    name: "Relay",
    handlers: {
      /**
       * One invocation per action message, from the Kafka subscription.
       *
       * @param {restate.Context} ctx @param {ActionEvent} event
       */
      handle: async (ctx, event) => {
        const d = event.data;
        const key = `${d.run_id}:${d.tool}:${d.business_id ?? ""}`;
        const { result, duplicate } = await ctx.objectClient(effect, key).perform(d.args);
        const outcome = {
          specversion: "1.0",
          type: "dev.idem.outcome.v1",
          source: "restate",
          id: ctx.rand.uuidv4(),
          subject: key,
          data: { idempotency_key: key, action_event_id: event.id, status: "succeeded", duplicate, result },
        };
        await ctx.run("publish", () => outbox.send(key, outcome));
      },
    },
  });

  return [relay, effect];
}

async function main() {
  const spec = JSON.parse(process.argv[2]);
  const kafka = new Kafka({
    clientId: "idem-bench-restate",
    brokers: spec.brokers.split(","),
    logLevel: logLevel.WARN,
  });
  const producer = kafka.producer({
    idempotent: true,
    createPartitioner: Partitioners.DefaultPartitioner,
  });
  await producer.connect();
  const outbox = new Outbox(producer, spec.outcomes);
  const port = await restate.serve({ services: services({ url: spec.url, outbox }), port: spec.port });
  console.log(`service listening on ${port}`);
  const stop = async () => {
    await producer.disconnect().catch(() => {});
    process.exit(0);
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
}

if (fileURLToPath(import.meta.url) === resolve(process.argv[1])) {
  await main();
}
