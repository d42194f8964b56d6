// A real idem stack for the client's tests: the relay binary, the fake downstream that counts
// effects, and the local Kafka and Postgres (`deploy/local/services.sh up` starts them).

import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtempSync, openSync, readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { Idem } from "../src/index.js";

const repo = resolve(fileURLToPath(import.meta.url), "../../../../..");
const bin = process.env.IDEM_BIN ?? join(repo, "target", "debug", "idem");
export const brokers = process.env.IDEM_TEST_KAFKA_BROKERS ?? "127.0.0.1:9092";
const postgres = process.env.IDEM_TEST_POSTGRES_URL ?? "postgres://idem:idem@127.0.0.1:5432/idem";

const tools = (downstream: string) => `
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to", "args.template"]
executor = { kind = "http", url = "${downstream}/v1/send_email", timeout = "1s" }
verify = { url = "${downstream}/v1/effects/{key}", max_attempts = 10, backoff = "100ms" }
retry = { max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }

[[tools]]
name = "refund"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.order_id", "args.amount"]
executor = { kind = "http", url = "${downstream}/v1/refund", timeout = "2s" }
`;

export function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => ok(port));
    });
  });
}

export async function eventually<T>(what: string, withinMs: number, check: () => Promise<T>): Promise<T> {
  const deadline = Date.now() + withinMs;
  for (;;) {
    try {
      const v = await check();
      if (v) return v;
    } catch {
      // not yet
    }
    if (Date.now() > deadline) throw new Error(`timed out after ${withinMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export class Stack {
  readonly actions: string;
  readonly outcomes: string;
  readonly config: string;
  private relay: ChildProcess | null = null;
  private constructor(
    readonly dir: string,
    readonly downstream: string,
    private readonly fake: ChildProcess,
    readonly adminPort: number,
    base: string,
  ) {
    this.actions = `${base}.actions`;
    this.outcomes = `${base}.outcomes`;
    this.config = join(dir, "idem.toml");
    writeFileSync(
      this.config,
      `
[kafka]
brokers = "${brokers}"
group_id = "${base}.group"
actions_topic = "${this.actions}"
outcomes_topic = "${this.outcomes}"
dlq_topic = "${base}.dlq"
partitions = 6

[postgres]
url = "${postgres}"
schema = "${base}"

[relay]
lease = "3s"
recovery_interval = "500ms"
outbox_poll_interval = "200ms"
shutdown_grace = "10s"

[admin]
listen = "127.0.0.1:${adminPort}"
${tools(downstream)}`,
    );
  }

  static async start(): Promise<Stack> {
    const dir = mkdtempSync(join(tmpdir(), "idem-ts-"));
    const port = await freePort();
    const fake = spawn(bin, ["fake-downstream", "--listen", `127.0.0.1:${port}`], {
      stdio: ["ignore", "ignore", openSync(join(dir, "downstream.log"), "a")],
    });
    const downstream = `http://127.0.0.1:${port}`;
    await eventually("the fake downstream", 20_000, async () => (await fetch(`${downstream}/_counts`)).ok);
    const stack = new Stack(dir, downstream, fake, await freePort(), `t_${randomUUID().replaceAll("-", "").slice(0, 12)}`);
    stack.idem("migrate");
    await stack.startRelay();
    return stack;
  }

  idem(command: string, ...args: string[]): string {
    const out = spawnSync(bin, [command, "--config", this.config, ...args], { timeout: 60_000 });
    if (out.status !== 0) throw new Error(`idem ${command}: ${out.stderr}`);
    return out.stdout.toString();
  }

  async startRelay(): Promise<void> {
    const log = openSync(join(this.dir, "relay.log"), "a");
    const relay = spawn(bin, ["relay", "--config", this.config], { stdio: ["ignore", log, log] });
    this.relay = relay;
    await eventually("the relay to be ready", 60_000, async () => {
      if (relay.exitCode !== null) throw new Error(readFileSync(join(this.dir, "relay.log"), "utf8"));
      return (await fetch(`http://127.0.0.1:${this.adminPort}/readyz`)).ok;
    });
  }

  async killRelay(signal: NodeJS.Signals = "SIGKILL"): Promise<void> {
    const relay = this.relay;
    if (!relay) return;
    const exited = new Promise((r) => relay.once("exit", r));
    relay.kill(signal);
    await exited;
    this.relay = null;
  }

  async counts(): Promise<{ total: number; requests: number; by_key: Record<string, number> }> {
    return (await fetch(`${this.downstream}/_counts`)).json() as any;
  }

  async effects(key: string): Promise<number> {
    return (await this.counts()).by_key[key] ?? 0;
  }

  async script(key: string, steps: unknown[]): Promise<void> {
    await fetch(`${this.downstream}/_script`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ key, steps }),
    });
  }

  client(): Promise<Idem> {
    return Idem.connect({ brokers, actionsTopic: this.actions, outcomesTopic: this.outcomes, source: "node-test" });
  }

  async stop(): Promise<void> {
    await this.killRelay();
    this.fake.kill("SIGKILL");
  }
}
