// The OpenAI Agents SDK adapter, driven by the SDK's own Runner with a scripted model (no LLM),
// against the real relay: an agent run twice with the same run id sends one email.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { Agent, Runner, Usage, type Model, type ModelRequest, type ModelResponse } from "@openai/agents";
import { z } from "zod";

import { Idem } from "../src/index.js";
import { idemTool } from "../src/openai-agents.js";
import { Stack } from "./stack.js";

const EMAIL = { to: "customer-1", template: "refund_approved", subject: "Your refund" };

/** Calls send_email once, then answers. */
class Scripted implements Model {
  async getResponse(request: ModelRequest): Promise<ModelResponse> {
    const items = Array.isArray(request.input) ? request.input : [];
    if (items.some((i: any) => i.type === "function_call_result")) {
      return {
        usage: new Usage(),
        output: [
          {
            type: "message",
            role: "assistant",
            status: "completed",
            content: [{ type: "output_text", text: "done" }],
          },
        ],
      };
    }
    return {
      usage: new Usage(),
      output: [
        {
          type: "function_call",
          callId: `call_${randomUUID().slice(0, 8)}`,
          name: "send_email",
          arguments: JSON.stringify(EMAIL),
          status: "completed",
        },
      ],
    };
  }
  getStreamedResponse(): AsyncIterable<any> {
    throw new Error("not streamed");
  }
}

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

test("a rerun of the agent executes nothing again", async () => {
  const runId = `run_${randomUUID().slice(0, 8)}`;
  const sendEmail = idemTool(
    idem,
    "send_email",
    z.object({ to: z.string(), template: z.string(), subject: z.string() }),
    { runId: () => runId, businessId: "order_js" },
  );
  const agent = new Agent({ name: "support", model: new Scripted(), tools: [sendEmail] });
  const runner = new Runner({ tracingDisabled: true });
  const toolOutput = async () => {
    const result = await runner.run(agent, "send the refund email");
    const outputs = result.newItems.filter((i) => i.type === "tool_call_output_item").map((i: any) => String(i.output));
    assert.equal(outputs.length, 1);
    return outputs[0];
  };
  const first = await toolOutput();
  // The process "crashed"; the run starts again with the same run id.
  const second = await toolOutput();
  assert.ok(!first.includes("not repeated"), first);
  assert.ok(second.includes("not repeated") && second.includes("Do not retry"), second);
  assert.equal(await stack.effects(`${runId}:send_email:order_js`), 1);
});
