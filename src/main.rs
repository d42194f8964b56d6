//! The `idem` binary: parses the command line, sets up logging, and hands the subcommand to
//! `cli`.

use clap::{Parser, ValueEnum};

mod cli;

// glibc's malloc and free were 38 % of the relay's CPU flat out (perf): every action's JSON is
// parsed, cloned and serialised several times between Kafka, Postgres and the downstream.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use cli::Command;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Exactly-once execution of agent tool calls over Kafka and Postgres"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Crash tests name failpoints in FAILPOINTS; compiled in only with the `failpoints` feature.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    cli::run(cli.command).await
}
