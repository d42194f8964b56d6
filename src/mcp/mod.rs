//! idem as an MCP server: every configured tool, listed with its description, argument schema
//! and hints; called through the relay like any agent's action, so a repeat is answered from
//! the record. Served over stdio by `idem mcp`, and over streamable HTTP at `/mcp` on the admin
//! listener.
//!
//! The run an action belongs to (and so its idempotency key) never comes from the model's
//! arguments: `--run-id`, the call's `_meta["dev.idem/run_id"]`, or the MCP session. A model
//! that rewords a call must not make it a new action.

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, RequestMetaObject,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler};
use serde_json::Value;
use tokio::sync::OnceCell;

use crate::config::Config;

pub mod answer;
mod caller;

pub use caller::{Call, Caller, Waiting};

/// `_meta` names a call may carry.
pub const META_RUN_ID: &str = "dev.idem/run_id";
pub const META_BUSINESS_ID: &str = "dev.idem/business_id";
pub const META_STEP: &str = "dev.idem/step";
/// `true`: a call that is waiting for approval waits for the decision instead of returning.
pub const META_WAIT_FOR_APPROVAL: &str = "dev.idem/wait_for_approval";

/// How long a call over `/mcp` waits for its outcome.
pub const HTTP_WAIT: Duration = Duration::from_secs(120);

/// How often a waiting call sends a progress notification (when the client asked for them).
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What every session of one process shares: the tools and one connection to Kafka.
pub struct Shared {
    tools: Vec<Tool>,
    kafka: crate::config::KafkaConfig,
    caller: OnceCell<Caller>,
    /// How long a call waits for its outcome.
    wait: Duration,
}

impl Shared {
    pub fn new(config: &Config, wait: Duration) -> anyhow::Result<Self> {
        Ok(Self {
            tools: tools(&crate::ops::catalogue(config))?,
            kafka: config.kafka.clone(),
            caller: OnceCell::new(),
            wait,
        })
    }

    /// The Kafka side, connected on first use (so a relay whose `/mcp` is never called holds no
    /// extra clients).
    async fn caller(&self) -> anyhow::Result<&Caller> {
        self.caller
            .get_or_try_init(|| Caller::connect(&self.kafka))
            .await
    }
}

/// MCP's tool list from idem's catalogue (`ops::catalogue`).
fn tools(catalogue: &Value) -> anyhow::Result<Vec<Tool>> {
    let output = answer::output_schema();
    let mut tools = Vec::new();
    for t in catalogue.as_array().into_iter().flatten() {
        let name = t["name"].as_str().unwrap_or_default();
        let class = t["class"].as_str().unwrap_or_default();
        let description = t["description"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{name} ({class}), through idem"));
        let input = match &t["input_schema"] {
            Value::Null => serde_json::json!({"type": "object"}),
            schema => schema.clone(),
        };
        let tool = serde_json::json!({
            "name": name,
            "description": description,
            "inputSchema": input,
            "outputSchema": output,
            "annotations": t["annotations"],
            "_meta": {"dev.idem/class": class, "dev.idem/approval": t["approval"]},
        });
        tools.push(
            serde_json::from_value(tool)
                .map_err(|e| anyhow::anyhow!("tool {name}: not an MCP tool: {e}"))?,
        );
    }
    Ok(tools)
}

/// One MCP session's server.
#[derive(Clone)]
pub struct IdemMcp {
    shared: Arc<Shared>,
    /// `--run-id`: every call of the process belongs to this run.
    run_id: Option<String>,
    /// The session's own id where the transport has none (stdio): one per connection.
    session: Option<String>,
}

impl IdemMcp {
    /// For stdio: one connection, one session, its id made here unless `run_id` is given.
    pub fn stdio(shared: Arc<Shared>, run_id: Option<String>) -> Self {
        Self {
            shared,
            run_id,
            session: Some(format!("mcp-{}", uuid::Uuid::new_v4())),
        }
    }

    /// For streamable HTTP: the session id is the `mcp-session-id` header.
    pub fn http(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            run_id: None,
            session: None,
        }
    }

    fn run_id(
        &self,
        meta: &RequestMetaObject,
        context: &RequestContext<RoleServer>,
    ) -> Option<String> {
        if let Some(r) = &self.run_id {
            return Some(r.clone());
        }
        if let Some(r) = meta.get(META_RUN_ID).and_then(Value::as_str) {
            return Some(r.to_string());
        }
        let header = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.headers.get("mcp-session-id"))
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        header.or_else(|| self.session.clone())
    }

    async fn call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let tool = request.name.to_string();
        if !self.shared.tools.iter().any(|t| t.name == tool) {
            return Err(ErrorData::invalid_params(
                format!("no tool named {tool:?}; tools/list names them"),
                None,
            ));
        }
        let mut meta = context.meta.clone();
        if let Some(m) = request.meta {
            meta.extend(m);
        }
        let Some(run_id) = self.run_id(&meta, &context) else {
            return Ok(error_result(format!(
                "no run id: without an MCP session, the call's _meta must name its run as \
                 {META_RUN_ID:?} (the run is part of the idempotency key)"
            )));
        };
        let step = match meta.get(META_STEP) {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(s) => Some(s),
                None => {
                    return Ok(error_result(format!(
                        "_meta {META_STEP:?} must be an integer, not {v}"
                    )))
                }
            },
        };
        let call = Call {
            tool: tool.clone(),
            args: Value::Object(request.arguments.unwrap_or_default()),
            run_id,
            business_id: meta
                .get(META_BUSINESS_ID)
                .and_then(Value::as_str)
                .map(str::to_string),
            step,
            source: format!(
                "mcp://{}",
                context
                    .client_info()
                    .map(|c| c.name)
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| "unnamed".to_string())
            ),
        };
        let wait_for_approval = meta.get(META_WAIT_FOR_APPROVAL) == Some(&Value::Bool(true));
        let caller = self.shared.caller().await.map_err(|e| {
            ErrorData::internal_error(format!("idem cannot reach Kafka: {e:#}"), None)
        })?;
        let waiting = caller
            .publish(&call)
            .await
            .map_err(|e| ErrorData::internal_error(format!("{e:#}"), None))?;
        tracing::info!(tool = %call.tool, run_id = %call.run_id, event_id = %waiting.id,
            source = %call.source, "mcp: action published");
        let progress = meta.get_progress_token();
        let event_id = waiting.id.clone();
        let answer = tokio::select! {
            // Cancellation stops the waiting, never the action.
            _ = context.ct.cancelled() => {
                tracing::info!(%event_id, "mcp: the client cancelled; the action goes on");
                return Err(ErrorData::internal_error("cancelled by the client; the action goes on", None));
            }
            answer = self.wait(waiting, &tool, wait_for_approval, progress, &context) => answer,
        };
        serde_json::from_value(answer).map_err(|e| {
            ErrorData::internal_error(format!("an outcome not shaped as MCP wants: {e}"), None)
        })
    }

    /// The outcome of the published action (or of its key, once decided) as a `tools/call`
    /// result, sending progress while it waits.
    async fn wait(
        &self,
        mut waiting: Waiting,
        tool: &str,
        wait_for_approval: bool,
        progress: Option<rmcp::model::ProgressToken>,
        context: &RequestContext<RoleServer>,
    ) -> Value {
        let started = tokio::time::Instant::now();
        let deadline = started + self.shared.wait;
        let mut tick = tokio::time::interval_at(started + PROGRESS_EVERY, PROGRESS_EVERY);
        let mut waiting_for = "the outcome";
        loop {
            tokio::select! {
                event = waiting.next() => {
                    let Some(event) = event else {
                        return error_value("idem's reader of outcomes stopped".into());
                    };
                    if let Some(key) = event["data"]["idempotency_key"].as_str() {
                        waiting.follow(key);
                    }
                    if wait_for_approval && event["data"]["status"] == "pending_approval" {
                        waiting_for = "approval";
                        continue;
                    }
                    return answer::answer(&event);
                }
                _ = tick.tick() => {
                    if let Some(token) = &progress {
                        let waited = started.elapsed();
                        let mut p = ProgressNotificationParam::new(token.clone(), waited.as_secs_f64());
                        p.message = Some(format!("waiting for {waiting_for} ({}s)", waited.as_secs()));
                        let _ = context.peer.notify_progress(p).await;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return answer::not_yet(self.shared.wait, tool);
                }
            }
        }
    }
}

fn error_value(text: String) -> Value {
    serde_json::json!({"content": [{"type": "text", "text": text}], "isError": true})
}

fn error_result(text: String) -> CallToolResult {
    serde_json::from_value(error_value(text)).expect("a text result is a CallToolResult")
}

impl ServerHandler for IdemMcp {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build());
        info.server_info = Implementation::new("idem", env!("CARGO_PKG_VERSION"));
        info.instructions = Some(
            "Each tool runs through idem: a repeat of a call (the same tool and key in the same \
             run) is answered from the record, marked duplicate, never executed twice. A call \
             waiting for approval returns at once: do not retry it."
                .to_string(),
        );
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.shared.tools.clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.call(request, context).await.map(Into::into)
    }
}
