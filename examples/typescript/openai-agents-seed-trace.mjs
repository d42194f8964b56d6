// The seed trace with the OpenAI Agents SDK for JavaScript and a scripted model (no API key):
// step 4 sends a refund email and the call times out after the email went out; step 5 re-plans
// and sends it again, reworded. idem looks downstream instead of sending again, and answers
// step 5 from its record: one email.
//
//   bash deploy/run-local.sh                                     # in another terminal
//   (cd clients/typescript && npm install && npm run build)
//   cd examples/typescript && npm install && node openai-agents-seed-trace.mjs

import { randomUUID } from "node:crypto";

import { Agent, Runner, Usage } from "@openai/agents";
import { Idem } from "idem-client";
import { idemTool } from "idem-client/openai-agents";
import { z } from "zod";

const downstream = process.env.IDEM_EXAMPLE_DOWNSTREAM ?? "http://127.0.0.1:8787";
const step4 = { to: "customer-1", template: "refund_approved", subject: "Your refund is on its way" };
const step5 = { ...step4, subject: "Re: your refund (resent)" };

/** Step 4 sends the email; step 5 re-plans and sends it again, reworded; then it answers. */
const scriptedModel = {
  async getResponse(request) {
    const items = Array.isArray(request.input) ? request.input : [];
    const sent = items.filter((i) => i.type === "function_call_result").length;
    if (sent < 2) {
      const args = JSON.stringify([step4, step5][sent]);
      return {
        usage: new Usage(),
        output: [{ type: "function_call", callId: `call_${sent}`, name: "send_email", arguments: args, status: "completed" }],
      };
    }
    const text = { type: "output_text", text: "The customer has been told." };
    return { usage: new Usage(), output: [{ type: "message", role: "assistant", status: "completed", content: [text] }] };
  },
  getStreamedResponse() {
    throw new Error("not streamed");
  },
};

const runId = `run_${randomUUID().slice(0, 8)}`;
// The demo downstream performs the next call, then never answers it.
await fetch(`${downstream}/_script`, {
  method: "POST",
  headers: { "content-type": "application/json" },
  body: JSON.stringify({ steps: ["effect_then_timeout"] }),
});
const idem = await Idem.fromEnv({ source: "example-openai-agents-js" });
try {
  const email = z.object({ to: z.string(), template: z.string(), subject: z.string() });
  const sendEmail = idemTool(idem, "send_email", email, { runId: () => runId, businessId: "order_8812", timeout: 120 });
  const agent = new Agent({ name: "support", model: scriptedModel, tools: [sendEmail] });
  const result = await new Runner({ tracingDisabled: true }).run(agent, "Tell customer-1 their refund was approved.");
  let step = 4;
  for (const item of result.newItems) {
    if (item.type === "tool_call_output_item") {
      console.log(`step ${step++}: send_email said: ${String(item.output).split("\n")[0]}`);
    }
  }
} finally {
  await idem.close();
}
const byKey = (await (await fetch(`${downstream}/_counts`)).json()).by_key;
const sent = Object.entries(byKey)
  .filter(([key]) => key.includes(runId))
  .reduce((n, [, count]) => n + count, 0);
console.log("emails sent:", sent);
