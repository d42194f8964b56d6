/**
 * OpenAI Agents SDK for JavaScript (`@openai/agents`): a tool whose every call goes through
 * idem.
 *
 * ```ts
 * import { idemTool } from "idem-client/openai-agents";
 * const sendEmail = idemTool(idem, "send_email", z.object({ to: z.string(), template: z.string() }),
 *   { runId: (ctx) => ctx?.context.runId, businessId: "order_8812" });
 * const agent = new Agent({ name: "support", tools: [sendEmail] });
 * ```
 *
 * The model reads the outcome's note and result: a repeat says "Already done …; not repeated.
 * Do not retry.", and a rerun of the agent with the same run id re-executes nothing.
 */

import { tool, type RunContext } from "@openai/agents";
import type { z } from "zod";

import { forModel, timedOut } from "./answer.js";
import { CallTimeout, type Idem } from "./index.js";

export interface IdemToolOptions<P extends z.ZodObject<any>> {
  /** The run id of this agent run (what makes a rerun a repeat). */
  runId: (ctx: RunContext<any> | undefined) => string;
  businessId?: string | ((ctx: RunContext<any> | undefined, args: z.infer<P>) => string | undefined);
  name?: string;
  description?: string;
  /** Seconds to wait for the outcome (default 30). */
  timeout?: number;
}

export function idemTool<P extends z.ZodObject<any>>(
  idem: Idem,
  toolName: string,
  parameters: P,
  options: IdemToolOptions<P>,
) {
  return tool({
    name: options.name ?? toolName,
    description: options.description ?? `Runs ${toolName} once, through idem.`,
    parameters: parameters as any,
    async execute(args: unknown, ctx?: RunContext<any>) {
      const businessId =
        typeof options.businessId === "function" ? options.businessId(ctx, args as z.infer<P>) : options.businessId;
      try {
        const outcome = await idem.call(toolName, args as Record<string, unknown>, {
          runId: options.runId(ctx),
          businessId,
          timeout: options.timeout,
          raiseOnStatus: false,
        });
        return forModel(outcome);
      } catch (e) {
        if (e instanceof CallTimeout) return timedOut(toolName, options.timeout ?? 30);
        throw e;
      }
    },
  });
}
