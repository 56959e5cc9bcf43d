//! `GET /openapi.json`: the OpenAPI 3.1 document of the gateway's
//! endpoints (`openapi.json` beside this file), their requests, and the
//! statuses and error objects they answer with, for clients' code
//! generators and for fuzzing the gateway against (`scripts/fuzz-gateway`).
//! As served, its `ModelName` lists the models the gateway serves.

use std::sync::{Arc, LazyLock};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::GatewayState;

/// The document, as written (its `ModelName` any string).
pub const OPENAPI: &str = include_str!("openapi.json");

static DOCUMENT: LazyLock<Value> =
    LazyLock::new(|| serde_json::from_str(OPENAPI).expect("openapi.json is JSON"));

pub(super) async fn document(State(gateway): State<Arc<GatewayState>>) -> Response {
    let mut document = DOCUMENT.clone();
    let models: Vec<String> = gateway
        .served()
        .routes
        .iter()
        .map(|r| r.model.clone())
        .collect();
    document["components"]["schemas"]["ModelName"]["enum"] = json!(models);
    axum::Json(document).into_response()
}
