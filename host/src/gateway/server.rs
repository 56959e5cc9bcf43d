//! The HTTP server: the router, the connection loop (a cap on open
//! connections, a deadline for each request's head), the drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Gateway;
use super::bounds::{Api, bounds};
use super::embeddings::embeddings;
use super::handlers::{answer, exposition, model, models, ready};
use super::messages::MessagesRequest;
use super::responses::ResponsesRequest;
use super::wire::{ApiError, CompletionRequest};
use super::{mcp, messages, openapi};

impl Gateway {
    /// Serves on `listener` until `shutdown` resolves, then stops accepting
    /// and gives the requests in flight `drain_timeout` to finish; those
    /// still running then end with an error (a stream with an error event
    /// before `[DONE]`), within a second more. At most `max_connections`
    /// are open at once, and each must send a request's head within
    /// `read_timeout` (also the longest a connection may sit idle).
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let config = &self.shared.config;
        let app = self.router();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(config.read_timeout);
        let graceful = GracefulShutdown::new();
        let connections = Arc::new(Semaphore::new(config.max_connections));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                accepted = accept(&listener, &connections) => accepted,
            };
            let Some((stream, place)) = accepted else {
                continue;
            };
            // Chunks go out as they are written: without it, a small SSE
            // chunk waits for the client's delayed ACK (40 ms).
            let _ = stream.set_nodelay(true);
            let service = TowerToHyperService::new(app.clone());
            let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
            let open = OpenConnection::count(&self.shared.metrics.connections);
            tokio::spawn(async move {
                let _ = connection.await;
                drop((open, place));
            });
        }
        drop(listener);
        self.shared.draining.send_replace(true);
        let drained = graceful.shutdown();
        tokio::pin!(drained);
        let drain = config.drain_timeout;
        if tokio::time::timeout(drain, &mut drained).await.is_err() {
            tracing::warn!(
                "requests still in flight after the {drain:?} drain; ending them with an error"
            );
            self.shared.cut.send_replace(true);
            // Their error answers (events) go out, then the server stops.
            let _ = tokio::time::timeout(CUT_GRACE, &mut drained).await;
        }
        Ok(())
    }

    /// Every API route behind its [`bounds`](super::bounds) (its key, its
    /// body, its place and memory, its metrics and log line), each with
    /// its API's way of writing errors.
    pub(super) fn router(&self) -> Router {
        let shared = &self.shared;
        let bounded = |api: Api| middleware::from_fn_with_state((shared.clone(), api), bounds);
        let chats = Api::chat(ApiError::into_response);
        let (mcp, sessions) = mcp::service(shared.clone());
        let mcp = Router::new()
            .route_service("/mcp", mcp)
            .layer(middleware::from_fn_with_state(
                (shared.clone(), sessions),
                mcp::admit::admit,
            ))
            .layer(bounded(Api::mcp(mcp::admit::refused)))
            .layer(middleware::from_fn_with_state(
                shared.clone(),
                mcp::admit::gate,
            ));
        let api = Router::new()
            .route(
                "/v1/chat/completions",
                post(answer::<CompletionRequest>).route_layer(bounded(chats)),
            )
            .route(
                "/v1/responses",
                post(answer::<ResponsesRequest>).route_layer(bounded(chats)),
            )
            .route(
                "/v1/messages",
                post(answer::<MessagesRequest>).route_layer(bounded(Api::chat(messages::refused))),
            )
            .route(
                "/v1/embeddings",
                post(embeddings).route_layer(bounded(Api::EMBEDDINGS)),
            );
        Router::new()
            .merge(api)
            .route("/v1/models", get(models))
            .route("/v1/models/{*model}", get(model))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(ready))
            .route("/metrics", get(exposition))
            .route("/openapi.json", get(openapi::document))
            .merge(mcp)
            .fallback(|| async {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    Some("unknown_url"),
                    "no such endpoint".to_owned(),
                )
            })
            .method_not_allowed_fallback(|| async {
                ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "invalid_request_error",
                    Some("method_not_allowed"),
                    "this endpoint does not take that method".to_owned(),
                )
            })
            .layer(DefaultBodyLimit::max(self.shared.config.max_body_bytes))
            .with_state(self.shared.clone())
    }
}

/// An open connection, counted while it lives (whatever ends it).
pub(super) struct OpenConnection(Gauge);

impl OpenConnection {
    pub(super) fn count(gauge: &Gauge) -> Self {
        gauge.inc();
        OpenConnection(gauge.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The next connection, once there is a place for it among the open ones;
/// `None` when accepting failed (then after a pause, if the failure was the
/// gateway's, such as running out of file descriptors, not the client's).
pub(super) async fn accept(
    listener: &TcpListener,
    places: &Arc<Semaphore>,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    let place = places.clone().acquire_owned().await.ok()?;
    match listener.accept().await {
        Ok((stream, _)) => Some((stream, place)),
        Err(e) if client_gone(&e) => None,
        Err(e) => {
            tracing::error!("accepting a connection failed: {e}; trying again in a second");
            tokio::time::sleep(Duration::from_secs(1)).await;
            None
        }
    }
}

/// Whether accepting failed because the client went away.
pub(super) fn client_gone(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}

/// How long answers cut at the end of a drain get to send their error.
pub(super) const CUT_GRACE: Duration = Duration::from_secs(1);
