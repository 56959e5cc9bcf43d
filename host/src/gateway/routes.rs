//! The routes a gateway serves and the keys that may use them.

use std::sync::Arc;

use axum::http::StatusCode;

use super::Route;
use super::mcp::McpEndpoint;
use super::wire::ApiError;
use crate::config::ClientKey;

#[derive(Clone)]
pub(super) struct RouteTable {
    pub(super) routes: Arc<[Route]>,
    /// The keys clients must present; none: the gateway is open.
    pub(super) keys: Arc<[ClientKey]>,
    /// The MCP endpoint (`/mcp`), if one is served.
    pub(super) mcp: Option<McpEndpoint>,
}

impl RouteTable {
    /// The routes `key` may use (all of them without keys).
    pub(super) fn routes_for<'a>(
        &'a self,
        key: Option<&'a ClientKey>,
    ) -> impl Iterator<Item = &'a Route> {
        self.routes
            .iter()
            .filter(move |route| key.is_none_or(|key| key.may_use(&route.model)))
    }

    /// The route of `model`, if `key` may use it; else a `404` naming the
    /// models it may use (the others do not exist for it).
    pub(super) fn route(&self, key: Option<&ClientKey>, model: &str) -> Result<&Route, ApiError> {
        self.routes
            .iter()
            .find(|route| route.model == model && key.is_none_or(|key| key.may_use(model)))
            .ok_or_else(|| {
                let models: Vec<&str> = self.routes_for(key).map(|r| r.model.as_str()).collect();
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    Some("model_not_found"),
                    format!(
                        "the model '{model}' does not exist; this gateway serves {}",
                        models.join(", ")
                    ),
                )
            })
    }

    pub(super) fn filters(&self) -> usize {
        self.routes.iter().map(|r| r.kernel.filters().count()).sum()
    }
}
