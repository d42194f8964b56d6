// The TypeScript client against the real relay, Kafka and Postgres; effects counted at a
// downstream that does not dedupe.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { CallTimeout, Idem, OutcomeUnknown, PendingApproval, Rejected } from "../src/index.js";
import { eventually, Stack } from "./stack.js";

const EMAIL = { to: "customer-1", template: "refund_approved", subject: "Your refund" };
const run = () => `run_${randomUUID().slice(0, 8)}`;

describe("one relay", () => {
  let stack: Stack;
  let idem: Idem;
  before(async () => {
    stack = await Stack.start();
    idem = await stack.client();
  });
  after(async () => {
    await idem.close();
    await stack.stop();
  });

  test("a second call is answered from the record", async () => {
    const runId = run();
    const first = await idem.call("send_email", EMAIL, { runId, businessId: "o1", step: 4 });
    assert.equal(first.status, "succeeded");
    assert.equal(first.duplicate, false);
    assert.equal(first.idempotencyKey, `${runId}:send_email:o1`);
    const again = await idem.call("send_email", { ...EMAIL, subject: "reworded" }, { runId, businessId: "o1", step: 5 });
    assert.equal(again.duplicate, true);
    assert.deepEqual(again.result, first.result);
    assert.equal(await stack.effects(first.idempotencyKey), 1);
  });

  test("a material change is rejected naming the field", async () => {
    const runId = run();
    await idem.call("send_email", EMAIL, { runId, businessId: "o2" });
    await assert.rejects(
      idem.call("send_email", { ...EMAIL, to: "customer-2" }, { runId, businessId: "o2" }),
      (e: unknown) => e instanceof Rejected && e.code === "key_conflict" && e.fields.join() === "args.to",
    );
    const out = await idem.call("send_email", { ...EMAIL, to: "customer-2" }, { runId, businessId: "o2", raiseOnStatus: false });
    assert.equal(out.status, "rejected");
    assert.equal(await stack.effects(`${runId}:send_email:o2`), 1);
  });

  test("a gated tool waits for approval, then runs once", async () => {
    const runId = run();
    const refund = { order_id: "o-9", amount: 120 };
    const pending = await idem.call("refund", refund, { runId, businessId: "t1" }).then(
      () => assert.fail("expected PendingApproval"),
      (e: unknown) => e,
    );
    assert.ok(pending instanceof PendingApproval);
    assert.equal(await stack.effects(pending.key), 0);
    stack.idem("approve", pending.key, "--by", "node-test", "--reason", "checked");
    const done = await idem.wait(pending, 60);
    assert.equal(done.status, "succeeded");
    assert.equal((await idem.call("refund", refund, { runId, businessId: "t1" })).duplicate, true);
    assert.equal(await stack.effects(pending.key), 1);
  });

  test("a downstream timeout is verified, not retried blind", async () => {
    const runId = run();
    const key = `${runId}:send_email:o5`;
    await stack.script(key, ["effect_then_timeout"]);
    const out = await idem.call("send_email", EMAIL, { runId, businessId: "o5", timeout: 60 });
    assert.equal(out.status, "succeeded");
    assert.equal(await stack.effects(key), 1);
  });

  test("an unknown outcome is thrown, never retried", async () => {
    const runId = run();
    const key = `${runId}:refund:u1`;
    await stack.script(key, ["effect_then_timeout"]);
    const pending = await idem.call("refund", { order_id: "u", amount: 5 }, { runId, businessId: "u1" }).catch((e) => e);
    assert.ok(pending instanceof PendingApproval);
    stack.idem("approve", key, "--by", "node-test", "--reason", "checked");
    await assert.rejects(idem.wait(pending, 60), (e: unknown) => e instanceof OutcomeUnknown && e.code === "outcome_unknown");
    assert.equal(await stack.effects(key), 1);
  });

  test("200 concurrent calls each get their own answer", async () => {
    const runId = run();
    const outs = await Promise.all(
      Array.from({ length: 200 }, (_, i) => idem.call("send_email", EMAIL, { runId, businessId: `c${i}`, timeout: 120 })),
    );
    assert.equal(new Set(outs.map((o) => o.actionEventId)).size, 200);
    assert.deepEqual(
      outs.map((o) => o.idempotencyKey).sort(),
      Array.from({ length: 200 }, (_, i) => `${runId}:send_email:c${i}`).sort(),
    );
    const counts = await stack.counts();
    assert.ok(outs.every((o) => counts.by_key[o.idempotencyKey] === 1));
  });
});

describe("a relay that stops", () => {
  test("calls waiting while the relay is killed are all answered once", async () => {
    const stack = await Stack.start();
    const idem = await stack.client();
    try {
      const runId = run();
      const keys = Array.from({ length: 20 }, (_, i) => `${runId}:send_email:k${i}`);
      for (const key of keys) await stack.script(key, [{ delay_ms: 1500 }]);
      const calls = keys.map((_, i) => idem.call("send_email", EMAIL, { runId, businessId: `k${i}`, timeout: 150 }));
      await eventually("calls in flight downstream", 60_000, async () => (await stack.counts()).requests > 0);
      await stack.killRelay("SIGKILL");
      await stack.startRelay();
      const outs = await Promise.all(calls);
      assert.deepEqual(outs.map((o) => o.idempotencyKey).sort(), [...keys].sort());
      const counts = await stack.counts();
      assert.ok(keys.every((k) => counts.by_key[k] === 1), JSON.stringify(counts.by_key));
    } finally {
      await idem.close();
      await stack.stop();
    }
  });

  test("a timed-out call resumes from the record", async () => {
    const stack = await Stack.start();
    const idem = await stack.client();
    try {
      const runId = run();
      await stack.killRelay("SIGTERM");
      await assert.rejects(
        idem.call("send_email", EMAIL, { runId, businessId: "r1", timeout: 2 }),
        (e: unknown) => e instanceof CallTimeout && e.eventId.length > 0,
      );
      await stack.startRelay();
      const resumed = await idem.call("send_email", EMAIL, { runId, businessId: "r1", timeout: 60 });
      assert.equal(resumed.duplicate, true);
      assert.equal(await stack.effects(resumed.idempotencyKey), 1);
    } finally {
      await idem.close();
      await stack.stop();
    }
  });
});
