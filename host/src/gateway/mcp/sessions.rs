//! The `/mcp` sessions of the initialize handshake, in memory, and which
//! key opened each. A session answers only the key that opened it: any
//! other key is told it does not exist, as for an id never given, so an id
//! seen in a log, a proxy or a neighbour's traffic grants nothing (it
//! would otherwise let another key read the session's stream and close
//! it).
//!
//! With a store for them (`[mcp_gateway] sessions`), each session's
//! handshake and opener are kept there too ([`Kept`]), so a replica that
//! has never seen a session restores it from the store (the SDK replays
//! its handshake) and serves it, to its opener only: a load balancer
//! needs no affinity. A kept session lives a day past its opening.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::session::store::{
    SessionState, SessionStore, SessionStoreError,
};

use super::McpEndpoint;
use crate::config::ClientKey;
use crate::gateway::GatewayState;
use crate::kv::KvStore;

/// The namespace of the kept sessions in their store.
const NAMESPACE: &str = "shallot-mcp-sessions";
/// How long a kept session lives.
const KEPT: Duration = Duration::from_secs(24 * 60 * 60);

/// A kept opener: a key's fingerprint in hex, or `-` for no key.
fn opener_text(key: Option<&ClientKey>) -> String {
    key.map_or_else(|| "-".to_owned(), |key| hex(&key.fingerprint()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The store the endpoint being served keeps its sessions in.
fn store_of(endpoint: Option<&McpEndpoint>) -> Option<Arc<dyn KvStore>> {
    endpoint.and_then(|endpoint| endpoint.sessions.clone())
}

/// The SDK's store of sessions' handshakes: the served endpoint's
/// `sessions` store, if it names one.
pub(super) struct Kept(pub(super) Weak<GatewayState>);

impl Kept {
    fn store(&self) -> Option<Arc<dyn KvStore>> {
        let shared = self.0.upgrade()?;
        store_of(shared.served().mcp.as_ref())
    }
}

#[async_trait::async_trait]
impl SessionStore for Kept {
    async fn load(&self, id: &str) -> Result<Option<SessionState>, SessionStoreError> {
        let Some(store) = self.store() else {
            return Ok(None);
        };
        let Some(entry) = store.get(NAMESPACE, &format!("state:{id}")).await? else {
            return Ok(None);
        };
        Ok(Some(serde_json::from_str(&entry.value)?))
    }

    async fn store(&self, id: &str, state: &SessionState) -> Result<(), SessionStoreError> {
        if let Some(store) = self.store() {
            let state = serde_json::to_string(state)?;
            store
                .set(NAMESPACE, None, &format!("state:{id}"), &state, Some(KEPT))
                .await?;
        }
        Ok(())
    }

    async fn delete(&self, id: &str) -> Result<(), SessionStoreError> {
        if let Some(store) = self.store() {
            store.delete(NAMESPACE, &format!("state:{id}")).await?;
            store.delete(NAMESPACE, &format!("opener:{id}")).await?;
        }
        Ok(())
    }
}

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

    /// Whether `key` may use the session `id`: one this replica opened or
    /// restored, or one the endpoint's store keeps, only if `key` opened
    /// it. An id neither knows is the SDK's to refuse; a store that fails
    /// to say is a refusal.
    pub(super) async fn may_use(
        &self,
        id: &str,
        key: Option<&ClientKey>,
        endpoint: &McpEndpoint,
    ) -> bool {
        let known = {
            let openers = self.openers.lock().unwrap_or_else(PoisonError::into_inner);
            openers.get(id).copied()
        };
        if let Some(opener) = known {
            return opener == key.map(ClientKey::fingerprint);
        }
        let Some(store) = store_of(Some(endpoint)) else {
            return true;
        };
        match store.get(NAMESPACE, &format!("opener:{id}")).await {
            Ok(Some(opener)) if opener.value == opener_text(key) => {
                let mut openers = self.openers.lock().unwrap_or_else(PoisonError::into_inner);
                openers.insert(id.to_owned(), key.map(ClientKey::fingerprint));
                true
            }
            Ok(Some(_)) | Err(_) => false,
            Ok(None) => true,
        }
    }

    /// `key` opened the session `id` (kept in the endpoint's store, if it
    /// has one); the openers of sessions since closed (deleted, idle past
    /// their time) are forgotten.
    pub(super) async fn opened(&self, id: &str, key: Option<&ClientKey>, endpoint: &McpEndpoint) {
        if let Some(store) = store_of(Some(endpoint)) {
            let (name, opener) = (format!("opener:{id}"), opener_text(key));
            let kept = store.set(NAMESPACE, None, &name, &opener, Some(KEPT));
            if let Err(e) = kept.await {
                tracing::warn!("an MCP session is not kept for other replicas: {e}");
            }
        }
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
