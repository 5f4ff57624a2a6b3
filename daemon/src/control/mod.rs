//! The local control API: HTTP + JSON, so the CLI, `curl`, the live page at `/` and a
//! Prometheus scraper at `/metrics` all speak to the daemon the same way.
//!
//! It only reads the node's state and sends commands, through a [`NodeHandle`]; it never
//! touches the model itself and knows nothing of how the node is wired. Every request needs
//! the node's access token, on loopback too, and must be for this API's host and from no
//! foreign web page ([`access`]): this API can stop the node, roll it back and read out its
//! weights. The token is made at the first start and found by the CLI without typing
//! ([`token`]); connections are bounded in number and in how long their headers take
//! ([`serve`]).
//!
//! The page (`assets/status.html`) is one self-contained file compiled into the binary:
//! nothing is fetched from elsewhere, since a lab's boxes may have no internet.

pub mod access;
pub mod evals;
pub mod serve;
pub mod token;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::handle::NodeHandle;
use crate::status::{ApiErrorBody, CheckpointView, Status};

/// Environment variable the daemon and CLI read the access token from.
pub const TOKEN_ENV: &str = "P2PTRAIN_API_TOKEN";

/// An error answer: a status code and one line.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ApiErrorBody { error: self.1 })).into_response()
    }
}

/// Why the control API could not be served.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The socket could not be bound.
    #[error("cannot listen on {addr} for the control API: {source}{hint}", hint = in_use_hint(source))]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's reason.
        source: std::io::Error,
    },
    /// The bound socket has no local address.
    #[error("control API socket: {0}")]
    Socket(std::io::Error),
}

fn in_use_hint(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        " (is another p2ptrain node running? pick another port with --api)"
    } else {
        ""
    }
}

/// Binds the API socket. Binding happens before the node writes anything, so a busy port
/// fails fast and leaves no trace.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| BindError::Listen { addr, source })
}

/// The API's routes over the node's handle, behind the checks of `access`.
pub fn router(shared: Arc<NodeHandle>, access: access::Access) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/evals", get(list_evals))
        .route(
            "/v1/checkpoints",
            get(list_checkpoints).post(save_checkpoint),
        )
        .route("/v1/checkpoints/{id}/file", get(download_checkpoint))
        .route("/v1/checkpoints/{id}/restore", post(restore_checkpoint))
        .route("/v1/stop", post(stop))
        .route("/metrics", get(metrics))
        .route("/", get(page))
        .layer(middleware::from_fn_with_state(
            Arc::new(access),
            access::check,
        ))
        .with_state(shared)
}

/// The live page: one HTML file with its script and styles inline.
const PAGE: &str = include_str!("../../assets/status.html");

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

async fn metrics(State(shared): State<Arc<NodeHandle>>) -> Result<Response, ApiError> {
    let status = shared.status().await;
    let text = crate::prometheus::render(&status, &shared.registry).map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot render metrics: {e}"),
        )
    })?;
    Ok((
        [(header::CONTENT_TYPE, crate::prometheus::CONTENT_TYPE)],
        text,
    )
        .into_response())
}

async fn status(State(shared): State<Arc<NodeHandle>>) -> Json<Status> {
    Json(shared.status().await)
}

async fn list_evals(
    State(shared): State<Arc<NodeHandle>>,
    Query(query): Query<evals::EvalsQuery>,
) -> Result<Json<evals::EvalsPage>, ApiError> {
    let path = shared.data_dir.join(crate::node::EVAL_LOG);
    let text = tokio::task::spawn_blocking(move || match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text),
        // No evaluation yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(Json(evals::page(
        &text,
        query.since,
        evals::EVALS_PER_RESPONSE,
    )))
}

async fn list_checkpoints(State(shared): State<Arc<NodeHandle>>) -> Json<Vec<CheckpointView>> {
    let store = shared.store.clone();
    let list = store.list().into_iter().map(|m| shared.view(m)).collect();
    Json(list)
}

async fn save_checkpoint(
    State(shared): State<Arc<NodeHandle>>,
) -> Result<Json<CheckpointView>, ApiError> {
    let meta = shared
        .checkpoint_now()
        .await
        .map_err(|e| ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    Ok(Json(shared.view(meta)))
}

fn parse_id(shared: &NodeHandle, id: &str) -> Result<u64, ApiError> {
    if id == "latest" {
        return shared
            .store
            .list()
            .last()
            .map(|m| m.id)
            .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "no checkpoint yet".into()));
    }
    id.parse().map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("checkpoint id {id:?} is not a number"),
        )
    })
}

async fn download_checkpoint(
    State(shared): State<Arc<NodeHandle>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&shared, &id)?;
    let meta = shared
        .store
        .get(id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no checkpoint with id {id}")))?;
    let path = shared.store.path_of(&meta);
    let bytes = tokio::fs::read(&path).await.map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{}: {e}", path.display()),
        )
    })?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{}\"", meta.file),
            ),
        ],
        Body::from(bytes),
    )
        .into_response())
}

async fn restore_checkpoint(
    State(shared): State<Arc<NodeHandle>>,
    Path(id): Path<String>,
) -> Result<Json<CheckpointView>, ApiError> {
    let id = parse_id(&shared, &id)?;
    let meta = shared
        .restore(id)
        .await
        .map_err(|e| ApiError(StatusCode::CONFLICT, e.to_string()))?;
    Ok(Json(shared.view(meta)))
}

async fn stop(State(shared): State<Arc<NodeHandle>>) -> Json<serde_json::Value> {
    shared.request_stop();
    Json(serde_json::json!({ "stopping": true }))
}
