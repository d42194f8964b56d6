//! An outcome event as MCP's `tools/call` result: `structuredContent` is the outcome's `data`,
//! `content` one text block a model can act on, `isError` for what did not succeed.

use serde_json::{json, Value};

/// The `outputSchema` of every tool: the `data` of an outcome event, from
/// `schemas/outcome-event.schema.json`.
pub fn output_schema() -> Value {
    let event: Value =
        serde_json::from_str(include_str!("../../schemas/outcome-event.schema.json"))
            .expect("schemas/outcome-event.schema.json is JSON");
    let mut data = event["properties"]["data"].clone();
    data["title"] = "idem outcome".into();
    data
}

/// Whether MCP should call this an error: the effect did not happen (`failed`, `rejected`), or
/// nobody knows yet whether it did (`unknown`).
pub fn is_error(status: &str) -> bool {
    matches!(status, "failed" | "rejected" | "unknown")
}

/// The `tools/call` result for one outcome event.
pub fn answer(event: &Value) -> Value {
    let data = &event["data"];
    let status = data["status"].as_str().unwrap_or("unknown");
    let mut text = status.to_string();
    if data["duplicate"] == true {
        text.push_str(" (duplicate: answered from the record, not executed again)");
    }
    if let Some(note) = data["note"].as_str().filter(|n| !n.is_empty()) {
        text.push_str(": ");
        text.push_str(note);
    }
    if let Some(error) = data["error"].as_object() {
        text.push_str(&format!(
            "\nerror: {} ({})",
            error.get("code").and_then(Value::as_str).unwrap_or("?"),
            error.get("message").and_then(Value::as_str).unwrap_or(""),
        ));
        if let Some(fields) = error.get("fields").and_then(Value::as_array) {
            if !fields.is_empty() {
                text.push_str(&format!("\nfields: {}", Value::Array(fields.clone())));
            }
        }
    }
    if !data["result"].is_null() {
        text.push_str(&format!("\nresult: {}", data["result"]));
    }
    text.push_str(&format!(
        "\nidempotency key: {}",
        data["idempotency_key"].as_str().unwrap_or("?")
    ));
    json!({
        "content": [{"type": "text", "text": text}],
        "structuredContent": data,
        "isError": is_error(status),
    })
}

/// The result when no outcome came within the wait: an error for the caller, though the
/// action is recorded (or on its way) and a repeat is answered from the record.
pub fn not_yet(waited: std::time::Duration, tool: &str) -> Value {
    json!({
        "content": [{"type": "text", "text": format!(
            "idem has not answered within {}s. The {tool} action is published and will be \
             carried out once; calling again with the same arguments in the same run is answered \
             from the record, never executed twice.",
            waited.as_secs()
        )}],
        "isError": true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(status: &str, duplicate: bool, error: Value) -> Value {
        json!({"data": {
            "idempotency_key": "run-1:send_email:42", "run_id": "run-1", "step": null,
            "tool": "send_email", "action_event_id": "e1", "status": status,
            "result": if status == "succeeded" { json!({"message_id": "m-1"}) } else { Value::Null },
            "error": error, "duplicate": duplicate, "attempts": 1, "note": "the note",
        }})
    }

    #[test]
    fn success_is_structured_and_not_an_error() {
        let a = answer(&outcome("succeeded", false, Value::Null));
        assert_eq!(a["isError"], false);
        assert_eq!(a["structuredContent"]["result"]["message_id"], "m-1");
        let text = a["content"][0]["text"].as_str().unwrap();
        assert!(text.starts_with("succeeded: the note"), "{text}");
        assert!(text.contains(r#"result: {"message_id":"m-1"}"#), "{text}");
        assert!(!text.contains("duplicate"), "{text}");
    }

    #[test]
    fn a_duplicate_says_so() {
        let a = answer(&outcome("succeeded", true, Value::Null));
        assert_eq!(a["isError"], false);
        assert_eq!(a["structuredContent"]["duplicate"], true);
        assert!(a["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("succeeded (duplicate"));
    }

    #[test]
    fn what_did_not_succeed_is_an_error_with_its_code() {
        for status in ["failed", "rejected", "unknown"] {
            let error = json!({"code": "key_conflict", "message": "m", "retryable": false,
                               "fields": ["args.to"]});
            let a = answer(&outcome(status, false, error));
            assert_eq!(a["isError"], true, "{status}");
            let text = a["content"][0]["text"].as_str().unwrap();
            assert!(text.contains("error: key_conflict (m)"), "{text}");
            assert!(text.contains(r#"fields: ["args.to"]"#), "{text}");
        }
        let pending = answer(&outcome("pending_approval", false, Value::Null));
        assert_eq!(pending["isError"], false);
    }

    #[test]
    fn the_output_schema_is_the_outcome_data() {
        let schema = output_schema();
        assert_eq!(schema["type"], "object");
        assert!(schema["required"]
            .as_array()
            .unwrap()
            .contains(&json!("status")));
        let validator = jsonschema::validator_for(&schema).unwrap();
        let data = outcome("succeeded", false, Value::Null)["data"].clone();
        assert!(validator.is_valid(&data));
    }
}
