// Starts the Restate peer for benches/relay.rs and keeps it running until killed.
//
//   node benches/restate/launch.mjs SPEC_JSON
//
// SPEC_JSON is {"brokers", "group", "actions", "outcomes", "url"}. The launcher starts
// restate-server (from the @restatedev/restate-server package, in a fresh temporary base dir,
// on free ports) and the service endpoint (service.mjs, HTTP/2), registers the Kafka cluster,
// the deployment and a subscription from the actions topic to `Relay/handle` through the admin
// API, waits until the subscription's consumer group has its members, and prints
// "restate peer ready" on stdout. Everything else it and its children say goes to stderr.
//
// SIGTERM or SIGINT stops both children and removes the base dir. The children also get SIGTERM
// from the kernel if the launcher dies without cleaning up (SIGKILL), through `setpriv
// --pdeathsig`; the base dir is then left under the system's temporary directory.

import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { Kafka, logLevel } from "kafkajs";

const here = dirname(fileURLToPath(import.meta.url));
const spec = JSON.parse(process.argv[2]);
const CLUSTER = "bench";
const READY_WITHIN_MS = 60_000;

const log = (/** @type {string} */ msg) => process.stderr.write(`restate peer: ${msg}\n`);

/**
 * `n` distinct ports nothing listens on now: the OS's choices for port 0, held until all are chosen.
 *
 * @param {number} n
 * @returns {Promise<number[]>}
 */
async function freePorts(n) {
  const servers = await Promise.all(
    Array.from({ length: n }, () => new Promise((resolve, reject) => {
      const s = createServer();
      s.once("error", reject);
      s.listen(0, "127.0.0.1", () => resolve(s));
    })),
  );
  const ports = servers.map((s) => /** @type {import("node:net").AddressInfo} */ (s.address()).port);
  await Promise.all(servers.map((s) => new Promise((r) => s.close(r))));
  return ports;
}

function serverBinary() {
  const require = createRequire(import.meta.url);
  return require.resolve(`@restatedev/restate-server-${process.platform}-${process.arch}/bin/restate-server`);
}

// Ask the kernel to SIGTERM the child when the launcher dies, if setpriv is at hand.
const setpriv = ["/usr/bin/setpriv", "/bin/setpriv"].find(existsSync);

/**
 * @param {string} cmd @param {string[]} args @param {NodeJS.ProcessEnv} [env]
 */
function start(cmd, args, env) {
  const [file, argv] = setpriv ? [setpriv, ["--pdeathsig", "TERM", "--", cmd, ...args]] : [cmd, args];
  return spawn(file, argv, { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, ...env } });
}

/**
 * @param {string} what @param {() => Promise<boolean>} ready
 */
async function waitFor(what, ready) {
  const deadline = Date.now() + READY_WITHIN_MS;
  while (!(await ready().catch(() => false))) {
    if (Date.now() > deadline) throw new Error(`${what} not ready within ${READY_WITHIN_MS} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/**
 * @param {string} admin @param {string} path @param {object} body
 */
async function post(admin, path, body) {
  const r = await fetch(`${admin}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(`POST ${path}: ${r.status} ${await r.text()}`);
  return r.json();
}

const base = mkdtempSync(join(tmpdir(), "idem-restate-"));
/** @type {import("node:child_process").ChildProcess[]} */
const children = [];
let stopping = false;

async function stop(code = 0) {
  if (stopping) return;
  stopping = true;
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill("SIGTERM");
  const exited = children.map((c) =>
    c.exitCode !== null || c.signalCode !== null ? Promise.resolve() : new Promise((r) => c.once("exit", r)),
  );
  // restate-server drains before it exits; the benchmark does not need its state any more.
  const force = setTimeout(() => children.forEach((c) => c.kill("SIGKILL")), 5_000);
  await Promise.all(exited);
  clearTimeout(force);
  rmSync(base, { recursive: true, force: true });
  process.exit(code);
}
process.on("SIGTERM", () => stop(0));
process.on("SIGINT", () => stop(0));

async function main() {
  const [ingressPort, adminPort, nodePort, servicePort] = await freePorts(4);
  const config = join(base, "restate.toml");
  writeFileSync(
    config,
    `# written by benches/restate/launch.mjs
node-name = "bench"
listen-mode = "tcp"
bind-address = "127.0.0.1:${nodePort}"
advertised-address = "http://127.0.0.1:${nodePort}/"
disable-telemetry = true
# octocrab is its check for a newer release on GitHub, which fails offline.
log-filter = "warn,octocrab=off"
shutdown-timeout = "5s"

[admin]
bind-address = "127.0.0.1:${adminPort}"

[ingress]
bind-address = "127.0.0.1:${ingressPort}"
`,
  );
  const admin = `http://127.0.0.1:${adminPort}`;

  const server = start(serverBinary(), ["--config-file", config, "--base-dir", join(base, "data"), "--no-logo"]);
  children.push(server);
  server.stdout?.pipe(process.stderr);

  const service = start(process.execPath, [join(here, "service.mjs"), JSON.stringify({ ...spec, port: servicePort })], {
    RESTATE_LOGGING: "WARN",
  });
  children.push(service);
  const serviceListening = new Promise((resolve) =>
    service.stdout?.on("data", (/** @type {Buffer} */ b) => {
      process.stderr.write(b);
      if (b.toString().includes("service listening")) resolve(undefined);
    }),
  );
  for (const c of children) {
    c.once("exit", (code, signal) => {
      if (!stopping) {
        log(`a child exited (code ${code}, signal ${signal}); stopping`);
        stop(1);
      }
    });
  }

  await waitFor("restate-server", async () => (await fetch(`${admin}/health`)).ok);
  await serviceListening;

  // Registering the cluster through the admin API: [[ingress.kafka-clusters]] in the config
  // file still works in 1.7 but is reported as deprecated.
  await post(admin, "/kafka-clusters", { name: CLUSTER, properties: { "bootstrap.servers": spec.brokers } });
  await post(admin, "/deployments", { uri: `http://127.0.0.1:${servicePort}` });
  const subscription = await post(admin, "/subscriptions", {
    source: `kafka://${CLUSTER}/${spec.actions}`,
    sink: "service://Relay/handle",
    options: { "group.id": spec.group, "auto.offset.reset": "earliest" },
  });
  log(`subscription ${subscription.id}: ${spec.actions} → Relay/handle, group ${spec.group}`);

  // Ready when the group has a member with partitions, so the benchmark's clock does not time
  // Kafka's rebalance.
  const kafkaAdmin = new Kafka({ brokers: spec.brokers.split(","), logLevel: logLevel.NOTHING }).admin();
  await kafkaAdmin.connect();
  await waitFor("the subscription's consumer group", async () => {
    const { groups } = await kafkaAdmin.describeGroups([spec.group]);
    return groups[0]?.state === "Stable" && groups[0].members.length > 0;
  });
  await kafkaAdmin.disconnect();
  console.log("restate peer ready");
}

main().catch((e) => {
  log(`failed: ${e?.stack ?? e}`);
  stop(1);
});
