//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (Kafka and Postgres are reachable).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use deadpool_postgres::Pool;

use crate::metrics::Metrics;

#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub pool: Pool,
    /// Set once topics exist and the consumer is subscribed; cleared when all brokers are down.
    pub kafka_up: Arc<AtomicBool>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, String) {
    let postgres = tokio::time::timeout(Duration::from_secs(2), async {
        let client = s.pool.get().await.ok()?;
        client.simple_query("select 1").await.ok()
    })
    .await
    .ok()
    .flatten()
    .is_some();
    let kafka = s.kafka_up.load(Ordering::Relaxed);
    let body = format!(
        "postgres: {}\nkafka: {}\n",
        if postgres { "ok" } else { "unreachable" },
        if kafka { "ok" } else { "unreachable" }
    );
    if postgres && kafka {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}
