/**
 * Call tools through idem: each action is executed once, and a repeat (a retry, a re-plan with
 * reworded arguments, a resumed run) is answered from the record instead of done again.
 *
 * ```ts
 * const idem = await Idem.connect({ brokers: "127.0.0.1:9092", source: "my-agent" });
 * const out = await idem.call("send_email", { to: "c-1", template: "refund_approved" },
 *                             { runId: "run_42", businessId: "order_8812", step: 4 });
 * out.note; // "Already done at …; not repeated. Do not retry."
 * await idem.close();
 * ```
 */

import { randomUUID } from "node:crypto";
import kafkajs, { type Consumer, type KafkaConfig, type Producer } from "kafkajs";
import lz4 from "lz4js";

// kafkajs is CommonJS: its values come through the default export.
const { CompressionCodecs, CompressionTypes, Kafka, logLevel, Partitioners } = kafkajs;

// The relay compresses outcome events with LZ4 (librdkafka's frame format), which kafkajs
// reads only through a codec: this one is pure JavaScript.
CompressionCodecs[CompressionTypes.LZ4] = () => ({
  async compress(encoder: { buffer: Buffer }) {
    return Buffer.from(lz4.compress(encoder.buffer));
  },
  async decompress(buffer: Buffer) {
    return Buffer.from(lz4.decompress(buffer));
  },
});

export const ACTION_TYPE = "dev.idem.action.v1";
const STRUCTURED = "application/cloudevents+json";
/** Outcome ids already seen, and keys whose newest outcome is kept: both bounded. */
const SEEN_IDS = 100_000;
const KEYS_KEPT = 10_000;

export type Status = "succeeded" | "failed" | "unknown" | "pending_approval" | "rejected";

/** Why an action was not done (`failed`, `rejected`) or may not have been (`unknown`). */
export interface OutcomeError {
  /** Machine-readable: `key_conflict`, `downstream_rejected`, `outcome_unknown`, … */
  code: string;
  message: string;
  /** Whether a *new* request may succeed later (the downstream was unavailable). */
  retryable: boolean;
  /** For `key_conflict`: the material fields that differ from the first request. */
  fields: string[];
}

/** One outcome event: what became of an action, and the sentence to show the model. */
export interface Outcome {
  /** The CloudEvent id: stable per (key, status change) and per answered action event. */
  id: string;
  status: Status;
  idempotencyKey: string;
  /** The action event this outcome answers. */
  actionEventId: string;
  runId: string | null;
  step: number | null;
  tool: string | null;
  /** The downstream's result: its JSON body, or the first one's for a duplicate. */
  result: unknown;
  error: OutcomeError | null;
  /** True when this answers a repeat: the effect was not performed again. */
  duplicate: boolean;
  attempts: number;
  /** One plain sentence for the model. */
  note: string;
  /** The whole CloudEvent as received. */
  raw: Record<string, unknown>;
}

/** Base of every outcome the client throws for. */
export class IdemError extends Error {
  constructor(readonly outcome: Outcome) {
    super(outcome.error ? `${outcome.error.code}: ${outcome.error.message}` : outcome.note);
    this.name = new.target.name;
  }
  get key(): string {
    return this.outcome.idempotencyKey;
  }
  get code(): string {
    return this.outcome.error?.code ?? "";
  }
  get retryable(): boolean {
    return this.outcome.error?.retryable ?? false;
  }
  get fields(): string[] {
    return this.outcome.error?.fields ?? [];
  }
}
/** Not accepted; nothing was executed (`key_conflict`, `schema_invalid`, a gate …). */
export class Rejected extends IdemError {}
/** Not done: the downstream refused, or stayed unavailable (`retryable`). */
export class Failed extends IdemError {}
/** Waiting for a person (`idem approve`). Do not retry: `idem.wait(err)` waits for it. */
export class PendingApproval extends IdemError {}
/** It may or may not have happened; never retried by the client: a person resolves it. */
export class OutcomeUnknown extends IdemError {}

/** No outcome within the timeout. Calling again with the same run id and business id (and
 * args) is answered from the record, never executed twice. */
export class CallTimeout extends Error {
  constructor(
    readonly eventId: string,
    readonly tool: string,
    readonly runId: string,
    timeout: number,
  ) {
    super(
      `no outcome for action ${eventId} (${tool}, run ${runId}) within ${timeout}s; ` +
        "call again with the same run id and business id to resume",
    );
    this.name = "CallTimeout";
  }
}

export interface IdemOptions {
  brokers: string | string[];
  actionsTopic?: string;
  outcomesTopic?: string;
  /** The CloudEvents `source` of the actions this client publishes. */
  source?: string;
  /** Passed to kafkajs for both clients: `ssl`, `sasl`, timeouts. */
  kafka?: Omit<KafkaConfig, "brokers">;
}

export interface CallOptions {
  runId: string;
  businessId?: string;
  step?: number;
  /** The orchestrator's own key; otherwise the tool's key template derives it. */
  idempotencyKey?: string;
  /** Seconds to wait for the outcome (default 30). */
  timeout?: number;
  /** Return every status instead of throwing for all but `succeeded`. */
  raiseOnStatus?: boolean;
  eventId?: string;
}

interface Waiter {
  resolve(o: Outcome): void;
  reject(e: unknown): void;
}

/**
 * A connection to idem through Kafka: an idempotent producer, and one consumer of the
 * outcomes topic shared by every call, reading from where the topic ended when the client
 * connected (a group id of its own), so no answer to a later call can be missed.
 */
export class Idem {
  readonly actionsTopic: string;
  readonly outcomesTopic: string;
  readonly source: string;
  private readonly byEvent = new Map<string, Waiter>();
  private readonly byKey = new Map<string, Waiter[]>();
  private readonly latest = new Map<string, Outcome>();
  private readonly seen = new Set<string>();
  private closed = false;

  private constructor(
    options: IdemOptions,
    private readonly producer: Producer,
    private readonly consumer: Consumer,
  ) {
    this.actionsTopic = options.actionsTopic ?? "idem.actions";
    this.outcomesTopic = options.outcomesTopic ?? "idem.outcomes";
    this.source = options.source ?? "idem-client";
  }

  /** Connects both clients and positions the outcome consumer at the topic's end. */
  static async connect(options: IdemOptions): Promise<Idem> {
    const kafka = new Kafka({
      clientId: options.source ?? "idem-client",
      logLevel: logLevel.NOTHING,
      ...options.kafka,
      brokers: Array.isArray(options.brokers) ? options.brokers : options.brokers.split(","),
    });
    const producer = kafka.producer({
      // A retried send repeats the same event id; the broker drops the copy.
      idempotent: true,
      maxInFlightRequests: 1,
      createPartitioner: Partitioners.DefaultPartitioner,
    });
    const consumer = kafka.consumer({ groupId: `idem-client-${randomUUID()}` });
    const idem = new Idem(options, producer, consumer);
    const admin = kafka.admin();
    await admin.connect();
    try {
      // Where the topic ends now: the consumer starts there, whatever its group join resolves.
      const ends = await admin.fetchTopicOffsets(idem.outcomesTopic);
      await producer.connect();
      await consumer.connect();
      await consumer.subscribe({ topics: [idem.outcomesTopic], fromBeginning: false });
      const joined = new Promise<void>((resolve) => {
        consumer.on(consumer.events.GROUP_JOIN, () => resolve());
      });
      await consumer.run({
        autoCommit: false,
        eachMessage: async ({ message }) => idem.take(message.value),
      });
      await joined;
      for (const { partition, offset } of ends) {
        consumer.seek({ topic: idem.outcomesTopic, partition, offset });
      }
    } catch (e) {
      await Promise.allSettled([producer.disconnect(), consumer.disconnect()]);
      throw e;
    } finally {
      await admin.disconnect();
    }
    return idem;
  }

  /** From `IDEM_KAFKA_BROKERS`, `IDEM_ACTIONS_TOPIC`, `IDEM_OUTCOMES_TOPIC`, `IDEM_SOURCE`. */
  static fromEnv(overrides: Partial<IdemOptions> = {}): Promise<Idem> {
    const env = process.env;
    return Idem.connect({
      brokers: env.IDEM_KAFKA_BROKERS ?? "127.0.0.1:9092",
      actionsTopic: env.IDEM_ACTIONS_TOPIC,
      outcomesTopic: env.IDEM_OUTCOMES_TOPIC,
      source: env.IDEM_SOURCE,
      ...overrides,
    });
  }

  /**
   * Publishes one action and resolves with the outcome that answers it: `succeeded` (with
   * `duplicate` true when the effect had already happened); otherwise, unless `raiseOnStatus`
   * is false, rejects with {@link Rejected}, {@link Failed}, {@link PendingApproval} or
   * {@link OutcomeUnknown}; {@link CallTimeout} when nothing answers in time.
   */
  async call(tool: string, args: Record<string, unknown>, options: CallOptions): Promise<Outcome> {
    if (this.closed) throw new Error("this Idem client is closed");
    const eventId = options.eventId ?? randomUUID();
    const timeout = options.timeout ?? 30;
    const data: Record<string, unknown> = { run_id: options.runId, tool, args };
    if (options.businessId !== undefined) data.business_id = options.businessId;
    if (options.step !== undefined) data.step = options.step;
    if (options.idempotencyKey !== undefined) data.idempotency_key = options.idempotencyKey;
    const event = {
      specversion: "1.0",
      id: eventId,
      source: this.source,
      type: ACTION_TYPE,
      time: new Date().toISOString(),
      datacontenttype: "application/json",
      data,
    };
    // Registered before the send: the answer may come before send() resolves.
    const answered = new Promise<Outcome>((resolve, reject) =>
      this.byEvent.set(eventId, { resolve, reject }),
    );
    try {
      await this.producer.send({
        topic: this.actionsTopic,
        acks: -1,
        messages: [
          {
            key: options.idempotencyKey ?? options.runId,
            value: JSON.stringify(event),
            headers: { "content-type": STRUCTURED },
          },
        ],
      });
    } catch (e) {
      this.byEvent.delete(eventId);
      throw e;
    }
    let timer: NodeJS.Timeout | undefined;
    const timedOut = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        this.byEvent.delete(eventId);
        reject(new CallTimeout(eventId, tool, options.runId, timeout));
      }, timeout * 1000);
    });
    try {
      return judged(await Promise.race([answered, timedOut]), options.raiseOnStatus ?? true);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Waits until a key waiting for approval is decided (or any key settles), and resolves or
   * rejects as {@link call} would. */
  async wait(
    keyOrOutcome: string | Outcome | IdemError,
    timeout = 60,
    raiseOnStatus = true,
  ): Promise<Outcome> {
    const key = keyOf(keyOrOutcome);
    const last = this.latest.get(key);
    if (last && last.status !== "pending_approval") return judged(last, raiseOnStatus);
    let timer: NodeJS.Timeout | undefined;
    let waiter: Waiter | undefined;
    const settled = new Promise<Outcome>((resolve, reject) => {
      waiter = { resolve, reject };
      const list = this.byKey.get(key) ?? [];
      list.push(waiter);
      this.byKey.set(key, list);
      timer = setTimeout(() => {
        this.byKey.set(key, (this.byKey.get(key) ?? []).filter((w) => w !== waiter));
        reject(new Error(`key ${key} not settled within ${timeout}s`));
      }, timeout * 1000);
    });
    try {
      return judged(await settled, raiseOnStatus);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Disconnects both clients; calls still waiting reject. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await Promise.allSettled([this.producer.disconnect(), this.consumer.disconnect()]);
    const closed = new Error("the Idem client was closed");
    for (const w of this.byEvent.values()) w.reject(closed);
    for (const ws of this.byKey.values()) for (const w of ws) w.reject(closed);
    this.byEvent.clear();
    this.byKey.clear();
  }

  /** One message of the outcomes topic. */
  private take(value: Buffer | null): void {
    if (!value) return;
    let outcome: Outcome;
    try {
      outcome = fromEvent(JSON.parse(value.toString("utf8")));
    } catch {
      return;
    }
    if (this.seen.has(outcome.id)) return;
    this.seen.add(outcome.id);
    if (this.seen.size > SEEN_IDS) this.seen.delete(this.seen.values().next().value as string);
    this.latest.delete(outcome.idempotencyKey);
    this.latest.set(outcome.idempotencyKey, outcome);
    if (this.latest.size > KEYS_KEPT) this.latest.delete(this.latest.keys().next().value as string);
    const waiting = this.byEvent.get(outcome.actionEventId);
    if (waiting) {
      this.byEvent.delete(outcome.actionEventId);
      waiting.resolve(outcome);
    }
    if (outcome.status !== "pending_approval") {
      const settled = this.byKey.get(outcome.idempotencyKey) ?? [];
      this.byKey.delete(outcome.idempotencyKey);
      for (const w of settled) w.resolve(outcome);
    }
  }
}

function keyOf(k: string | Outcome | IdemError): string {
  if (typeof k === "string") return k;
  if (k instanceof IdemError) return k.key;
  return k.idempotencyKey;
}

/** Reads an outcome CloudEvent; throws on anything that is not one. */
export function fromEvent(event: Record<string, any>): Outcome {
  const d = event.data;
  if (typeof event.id !== "string" || !d || typeof d.status !== "string") {
    throw new Error("not an outcome event");
  }
  return {
    id: event.id,
    status: d.status,
    idempotencyKey: d.idempotency_key,
    actionEventId: d.action_event_id,
    runId: d.run_id ?? null,
    step: d.step ?? null,
    tool: d.tool ?? null,
    result: d.result ?? null,
    error: d.error
      ? {
          code: d.error.code,
          message: d.error.message,
          retryable: Boolean(d.error.retryable),
          fields: d.error.fields ?? [],
        }
      : null,
    duplicate: Boolean(d.duplicate),
    attempts: Number(d.attempts ?? 0),
    note: d.note ?? "",
    raw: event,
  };
}

function judged(outcome: Outcome, raiseOnStatus: boolean): Outcome {
  if (!raiseOnStatus || outcome.status === "succeeded") return outcome;
  switch (outcome.status) {
    case "rejected":
      throw new Rejected(outcome);
    case "failed":
      throw new Failed(outcome);
    case "pending_approval":
      throw new PendingApproval(outcome);
    case "unknown":
      throw new OutcomeUnknown(outcome);
  }
  return outcome;
}
