import type { Outcome } from "./index.js";

/** What a framework's tool returns to the model for an outcome: the note first (it says
 * whether to retry), then the result or the error as JSON. */
export function forModel(outcome: Outcome): string {
  const body =
    outcome.status === "succeeded"
      ? outcome.result
      : outcome.error
        ? { error: outcome.error.code, message: outcome.error.message, fields: outcome.error.fields }
        : { status: outcome.status };
  return `${outcome.note}\n${JSON.stringify(body)}`;
}
