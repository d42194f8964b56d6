//! The tool catalogue: what each configured tool is, as `idem tools`, `GET /v1/tools` (and
//! MCP's `tools/list`) show it. One function, so they never disagree.

use serde_json::{json, Value};

use crate::config::{Approval, Config, Tool, ToolClass};

/// Every configured tool: name, class, description, the schema of its `args`, its key
/// template and material fields, its gate, and MCP's hints for its class.
pub fn catalogue(config: &Config) -> Value {
    Value::Array(config.tools.iter().map(entry).collect())
}

fn entry(tool: &Tool) -> Value {
    let names = |fields: &[crate::config::FieldPath]| -> Vec<String> {
        fields.iter().map(|f| f.0.clone()).collect()
    };
    let approval = match &tool.approval {
        Approval::None => json!("none"),
        Approval::Required => json!("required"),
        Approval::Above { field, threshold } => json!({"field": field.0, "above": threshold}),
    };
    json!({
        "name": tool.name,
        "class": tool.class.as_str(),
        "description": tool.description,
        "input_schema": tool.input_schema.as_ref().map(|s| s.schema.clone()),
        "key": names(&tool.key),
        "material": names(&tool.material),
        "approval": approval,
        "max_per_run": tool.max_per_run,
        // MCP's tool annotations: a dangerous tool is destructive, yet idempotent through idem
        // (a repeat is answered, not executed).
        "annotations": {
            "readOnlyHint": tool.class == ToolClass::ReadOnly,
            "idempotentHint": true,
            "destructiveHint": tool.class == ToolClass::Dangerous,
        },
    })
}

/// The catalogue as lines for a terminal.
pub fn render(catalogue: &Value) -> String {
    let mut out = String::new();
    for t in catalogue.as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{}  ({})\n  {}\n  key:       {}\n  material:  {}\n  approval:  {}\n  schema:    {}\n\n",
            t["name"].as_str().unwrap_or_default(),
            t["class"].as_str().unwrap_or_default(),
            t["description"].as_str().unwrap_or("(no description)"),
            t["key"],
            t["material"],
            t["approval"],
            if t["input_schema"].is_null() {
                "(none: args are not checked before the call)".to_string()
            } else {
                t["input_schema"].to_string()
            },
        ));
    }
    out
}
