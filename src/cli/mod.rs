//! The subcommands: each parses its arguments and calls the library (approve, deny, resolve
//! and explain call the same functions as the admin API).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;

use idem::config::Config;

mod publish;

#[derive(Clone, Copy, ValueEnum)]
pub enum ResolveAs {
    Succeeded,
    Failed,
    Retry,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the relay in the foreground until SIGTERM or SIGINT.
    Relay {
        #[arg(long)]
        config: PathBuf,
    },
    /// Apply the Postgres schema (safe to run twice, and from two hosts at once).
    Migrate {
        #[arg(long)]
        config: PathBuf,
    },
    /// Publish one action event to the actions topic, and optionally wait for its outcome.
    Publish(publish::Publish),
    /// Everything about one key: deliveries (and why each came), attempts, decisions, outcomes.
    Explain {
        #[arg(long)]
        config: PathBuf,
        key: String,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Settle a key parked `unknown`, after checking downstream what really happened.
    Resolve {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long = "as", value_enum)]
        resolution: ResolveAs,
        /// Who decided (recorded).
        #[arg(long, env = "USER")]
        by: String,
        /// Why (recorded).
        #[arg(long)]
        reason: String,
        /// Only if the key still stands for this request (the fingerprint `explain` shows).
        #[arg(long)]
        fingerprint: Option<String>,
    },
    /// Approve a key waiting for approval: it executes once, with the request recorded.
    Approve {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long, env = "USER")]
        by: String,
        #[arg(long, default_value = "approved")]
        reason: String,
        /// The material fingerprint you looked at (`idem explain`): refused if it changed.
        #[arg(long)]
        fingerprint: Option<String>,
    },
    /// Deny a key waiting for approval: it is rejected and never executed.
    Deny {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long, env = "USER")]
        by: String,
        #[arg(long)]
        reason: String,
    },
    /// Each configured tool: class, key template, material fields, gate and argument schema.
    Tools {
        #[arg(long)]
        config: PathBuf,
        /// Print JSON (what `GET /v1/tools` answers) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// An MCP server on stdin/stdout: the configured tools, each call published as an action
    /// and answered with its outcome (logs go to stderr).
    Mcp {
        #[arg(long)]
        config: PathBuf,
        /// The run every call belongs to; otherwise the call's `_meta["dev.idem/run_id"]`, or
        /// this MCP session (one per process).
        #[arg(long)]
        run_id: Option<String>,
        /// How long a call waits for its outcome before it returns "not answered yet".
        #[arg(long, default_value = "120s", value_parser = humantime_secs)]
        wait: std::time::Duration,
    },
    /// Delete finished keys past their retention now (the relay also does it periodically).
    Prune {
        #[arg(long)]
        config: PathBuf,
    },
    /// Run the fake downstream that counts side effects (the example tools point at it).
    FakeDownstream {
        #[arg(long, default_value = "127.0.0.1:8787")]
        listen: std::net::SocketAddr,
        /// Replay the first result for a repeated Idempotency-Key instead of a new effect.
        #[arg(long)]
        honor_key: bool,
    },
}

/// A duration such as `120s`, `2m` or `500ms`, as the config file writes them.
fn humantime_secs(s: &str) -> Result<std::time::Duration, String> {
    idem::config::parse_duration(s)
        .ok_or_else(|| format!("{s:?} is not a duration such as 500ms, 30s, 2m"))
}

fn load(path: &std::path::Path) -> anyhow::Result<Config> {
    Ok(Config::load(path, |k| std::env::var(k).ok())?)
}

/// `approve` and `deny`: the same function the admin API calls.
async fn decide(
    config: &std::path::Path,
    key: &str,
    decision: idem::gates::Decision,
    by: &str,
    reason: &str,
    fingerprint: Option<&str>,
) -> anyhow::Result<()> {
    let config = load(config)?;
    let pool = idem::db::pool(&config.postgres)?;
    let schema = &config.postgres.schema;
    idem::gates::decide(&pool, schema, key, decision, by, reason, fingerprint).await?;
    Ok(())
}

/// Runs one subcommand to its end.
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Relay { config } => {
            let config = load(&config)?;
            let shutdown = CancellationToken::new();
            let signal = shutdown.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                signal.cancel();
            });
            idem::telemetry::init()?;
            let ran = idem::relay::run(config, shutdown).await;
            // The batch processor flushes on its own thread, which blocks: not on a worker.
            tokio::task::spawn_blocking(idem::telemetry::shutdown).await?;
            ran?;
        }
        Command::Migrate { config } => {
            let config = load(&config)?;
            let applied = idem::db::migrate(&config.postgres).await?;
            if applied.is_empty() {
                println!("schema {} is up to date", config.postgres.schema);
            } else {
                println!(
                    "schema {}: applied migrations {applied:?}",
                    config.postgres.schema
                );
            }
        }
        Command::Publish(p) => publish::publish(p).await?,
        Command::Explain { config, key, json } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            let e = idem::ops::explain(&pool, &key).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&e)?);
            } else {
                print!("{}", idem::ops::render(&e));
            }
        }
        Command::Resolve {
            config,
            key,
            resolution,
            by,
            reason,
            fingerprint,
        } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            let how = match resolution {
                ResolveAs::Succeeded => idem::ops::Resolution::Succeeded,
                ResolveAs::Failed => idem::ops::Resolution::Failed,
                ResolveAs::Retry => idem::ops::Resolution::Retry,
            };
            idem::ops::resolve(
                &pool,
                &config.postgres.schema,
                &key,
                how,
                &by,
                &reason,
                fingerprint.as_deref(),
            )
            .await?;
            println!("{key}: resolved as {} by {by}", how.as_str());
        }
        Command::Approve {
            config,
            key,
            by,
            reason,
            fingerprint,
        } => {
            let d = idem::gates::Decision::Approve;
            decide(&config, &key, d, &by, &reason, fingerprint.as_deref()).await?;
            println!("{key}: approved by {by}");
        }
        Command::Deny {
            config,
            key,
            by,
            reason,
        } => {
            let d = idem::gates::Decision::Deny;
            decide(&config, &key, d, &by, &reason, None).await?;
            println!("{key}: denied by {by}");
        }
        Command::Tools { config, json } => {
            let catalogue = idem::ops::catalogue(&load(&config)?);
            if json {
                println!("{}", serde_json::to_string_pretty(&catalogue)?);
            } else {
                print!("{}", idem::ops::render_catalogue(&catalogue));
            }
        }
        Command::Mcp {
            config,
            run_id,
            wait,
        } => {
            let config = load(&config)?;
            let shared = std::sync::Arc::new(idem::mcp::Shared::new(&config, wait)?);
            let server = idem::mcp::IdemMcp::stdio(shared, run_id);
            let running = rmcp::ServiceExt::serve(server, rmcp::transport::stdio())
                .await
                .context("the MCP handshake on stdio failed")?;
            running.waiting().await?;
        }
        Command::Prune { config } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            // Paced like a relay's pruning (`relay.prune_share`); Ctrl-C stops it between batches.
            let stop = CancellationToken::new();
            let signal = stop.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                signal.cancel();
            });
            let n = idem::gates::prune(&pool, &config, &stop).await?;
            println!("pruned {n} expired keys (tombstones kept)");
        }
        Command::FakeDownstream { listen, honor_key } => {
            let shutdown = CancellationToken::new();
            let signal = shutdown.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                signal.cancel();
            });
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            tracing::info!(%listen, honor_key, "fake downstream serving");
            idem::fake_downstream::FakeDownstream::new(honor_key)
                .serve(listener, shutdown)
                .await?;
        }
    }
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
