// The runnable example (examples/typescript), run against a test relay: it prints the seed
// trace and exactly one email sent.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { test } from "node:test";

import { brokers, Stack } from "./stack.js";

const examples = resolve(fileURLToPath(import.meta.url), "../../../../../examples/typescript");

test("the OpenAI Agents example sends one email", async () => {
  const stack = await Stack.start();
  try {
    const out = spawnSync(process.execPath, [join(examples, "openai-agents-seed-trace.mjs")], {
      env: {
        ...process.env,
        IDEM_KAFKA_BROKERS: brokers,
        IDEM_ACTIONS_TOPIC: stack.actions,
        IDEM_OUTCOMES_TOPIC: stack.outcomes,
        IDEM_EXAMPLE_DOWNSTREAM: stack.downstream,
      },
      timeout: 180_000,
      encoding: "utf8",
    });
    assert.equal(out.status, 0, out.stderr);
    const lines = out.stdout.trim().split("\n");
    assert.equal(lines.at(-1), "emails sent: 1", out.stdout);
    assert.ok(lines.some((l) => l.startsWith("step 5:") && l.includes("not repeated")), out.stdout);
  } finally {
    await stack.stop();
  }
});
