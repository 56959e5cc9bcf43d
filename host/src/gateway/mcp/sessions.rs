//! The `/mcp` sessions of the initialize handshake, in memory, and which
//! key opened each. A session answers only the key that opened it: any
//! other key is told it does not exist, as for an id never given, so an id
//! seen in a log, a proxy or a neighbour's traffic grants nothing (it
//! would otherwise let another key read the session's stream and close
//! it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

use crate::config::ClientKey;

/// The header a session's id travels in, both ways.
pub(super) const SESSION_ID: &str = "mcp-session-id";

pub(crate) struct Sessions {
    pub(super) manager: Arc<LocalSessionManager>,
    /// Each open session's opener (`None`: a gateway without keys).
    openers: Mutex<HashMap<String, Option<[u8; 32]>>>,
}

impl Sessions {
    pub(super) fn new(manager: Arc<LocalSessionManager>) -> Self {
        Sessions {
            manager,
            openers: Mutex::default(),
        }
    }

    /// Whether `key` may use the session `id`. An id no key opened is the
    /// SDK's to refuse.
    pub(super) fn may_use(&self, id: &str, key: Option<&ClientKey>) -> bool {
        let openers = self.openers.lock().unwrap_or_else(PoisonError::into_inner);
        openers
            .get(id)
            .is_none_or(|opener| *opener == key.map(ClientKey::fingerprint))
    }

    /// `key` opened the session `id`; the openers of sessions since closed
    /// (deleted, idle past their time) are forgotten.
    pub(super) async fn opened(&self, id: &str, key: Option<&ClientKey>) {
        let open = self.manager.sessions.read().await;
        let mut openers = self.openers.lock().unwrap_or_else(PoisonError::into_inner);
        openers.retain(|id, _| open.contains_key(id.as_str()));
        openers.insert(id.to_owned(), key.map(ClientKey::fingerprint));
    }
}

/// What the SDK answers for a session it does not have, word for word, so
/// another key's session looks like no session at all.
pub(super) fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response()
}
