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

/** What the model reads when no outcome came in time: retrying is safe, and how. */
export function timedOut(tool: string, timeout: number): string {
  return (
    `No answer from ${tool} within ${timeout}s; it may still be running. Calling it again ` +
    "with the same arguments returns its outcome; it is never executed twice."
  );
}
