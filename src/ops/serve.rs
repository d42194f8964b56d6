//! The admin listener's HTTP server: hyper with the limits `axum::serve` does not set. A
//! connection must send its request head within `header_timeout` (idle keep-alive connections
//! too), a request must be answered within `request_timeout`, and connections past
//! `max_connections` are closed as soon as they are accepted.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How the admin server bounds its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: usize,
}

/// How long open connections may take to finish their requests once `stop` is cancelled.
const DRAIN: Duration = Duration::from_secs(5);

/// Serves `router` on `listener` until `stop` is cancelled, then lets open connections finish
/// their requests (for at most `DRAIN`).
pub async fn serve(listener: TcpListener, router: Router, limits: Limits, stop: CancellationToken) {
    let timeout = limits.request_timeout;
    let router = router.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| answer_within(timeout, req, next),
    ));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut connections = JoinSet::new();
    loop {
        let tcp = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                // Out of file descriptors and the like: the next accept may succeed.
                Err(e) => {
                    tracing::warn!(error = %e, "admin listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Reap the finished ones so the set stays as large as the open connections.
        while connections.try_join_next().is_some() {}
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(
                max_connections = limits.max_connections,
                "admin listener: connection refused, too many open"
            );
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = http.serve_connection(TokioIo::new(tcp), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stop.cancelled() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    let drained = tokio::time::timeout(DRAIN, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("admin listener: connections still open after {DRAIN:?}, closed");
    }
}

/// A request (its body read included) answered within `timeout`, or 503.
async fn answer_within(timeout: Duration, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({
                "error": format!("the request was not answered within {timeout:?}")
            })),
        )
            .into_response(),
    }
}
