//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (Kafka and Postgres are reachable).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
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
        .route("/v1/actions/{key}", get(explain))
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

async fn explain(State(s): State<AdminState>, Path(key): Path<String>) -> Response {
    match crate::inspect::explain(&s.pool, &key).await {
        Ok(e) => Json(e).into_response(),
        Err(e @ crate::inspect::InspectError::NotFound(_)) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
    }
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
