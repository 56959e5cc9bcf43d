//! What a server offers beside its tools: prompts (named with the
//! server's prefix, as its tools are), resources and resource templates
//! (by their URIs, unchanged), listed when it starts and again when it
//! says they changed; and the requests that use them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use rmcp::model::{
    CompleteRequestParams, CompleteResult, Prompt, Resource, ResourceTemplate, ServerCapabilities,
};
use rmcp::service::{Peer, RoleClient, ServiceError};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::McpServer;
use crate::types::{ChainError, ErrorKind};

/// A server's prompts, resources and templates as last listed, and the
/// resources it has said were updated.
pub(super) struct Offered {
    pub(super) held: RwLock<Listing>,
    /// URIs the server said changed (`notifications/resources/updated`).
    pub(super) updated: broadcast::Sender<String>,
    /// How many watch each URI the server was asked to say changes of.
    watched: Mutex<HashMap<String, usize>>,
}

impl Default for Offered {
    fn default() -> Self {
        Offered {
            held: RwLock::default(),
            updated: broadcast::Sender::new(64),
            watched: Mutex::default(),
        }
    }
}

/// One watch of a resource: the server is asked to say when it changes
/// while any watch of it lives, and told to stop when the last goes.
pub struct ResourceWatch {
    server: Arc<McpServer>,
    uri: String,
}

impl Drop for ResourceWatch {
    fn drop(&mut self) {
        let watched = self.server.listed.offered.watched.lock();
        let mut watched = watched.unwrap_or_else(PoisonError::into_inner);
        let Some(count) = watched.get_mut(&self.uri) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        watched.remove(&self.uri);
        if !self.server.listing().subscribes {
            return;
        }
        let (server, uri) = (self.server.clone(), std::mem::take(&mut self.uri));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = server.subscribe(&uri, false).await {
                    tracing::debug!(server = %server.config.name, "resources/unsubscribe: {e}");
                }
            });
        }
    }
}

/// What one listing found.
#[derive(Default, Clone, PartialEq)]
pub(super) struct Listing {
    prompts: Vec<Prompt>,
    resources: Vec<Resource>,
    templates: Vec<ResourceTemplate>,
    /// Whether the server takes `resources/subscribe` (one that does not
    /// may still say a resource was updated).
    subscribes: bool,
}

/// The most of each kind a server may list: more is cut, and said in the
/// log.
const LISTED_CAP: usize = 1024;

impl Offered {
    pub(super) fn held(&self) -> Listing {
        let held = self.held.read();
        held.unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Keeps `listing`; whether it differs from the one before.
    pub(super) fn keep(&self, listing: Listing) -> bool {
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        let changed = *held != listing;
        *held = listing;
        changed
    }
}

impl Listing {
    /// What `peer` offers, of what its capabilities say it has.
    pub(super) async fn fetch(peer: &Peer<RoleClient>) -> Result<Listing, String> {
        let capabilities = peer.peer_info().map(|info| info.capabilities.clone());
        let has = |pick: fn(&ServerCapabilities) -> bool| capabilities.as_ref().is_some_and(pick);
        let failed = |what: &str, e: ServiceError| format!("{what} failed: {e}");
        let mut listing = Listing::default();
        if has(|c| c.prompts.is_some()) {
            listing.prompts = peer
                .list_all_prompts()
                .await
                .map_err(|e| failed("prompts/list", e))?;
        }
        listing.subscribes = has(|c| {
            c.resources
                .as_ref()
                .is_some_and(|r| r.subscribe == Some(true))
        });
        if has(|c| c.resources.is_some()) {
            listing.resources =
                (peer.list_all_resources().await).map_err(|e| failed("resources/list", e))?;
            listing.templates = (peer.list_all_resource_templates().await)
                .map_err(|e| failed("resources/templates/list", e))?;
        }
        listing.prompts.truncate(LISTED_CAP);
        listing.resources.truncate(LISTED_CAP);
        listing.templates.truncate(LISTED_CAP);
        Ok(listing)
    }
}

/// Whether `uri` is one `template` (RFC 6570, as servers write them:
/// `{var}` one path segment, `{+var}` and `{#var}` any run) names.
fn matches(template: &str, uri: &str) -> bool {
    let mut pattern = String::from("^");
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        pattern.push_str(&regex_lite::escape(&rest[..open]));
        let Some(close) = rest[open..].find('}') else {
            return false;
        };
        let expression = &rest[open + 1..open + close];
        pattern.push_str(match expression.chars().next() {
            Some('+' | '#') => ".+",
            Some('?' | '&') => r"(\?.*)?",
            _ => "[^/?#]+",
        });
        rest = &rest[open + close + 1..];
    }
    pattern.push_str(&regex_lite::escape(rest));
    pattern.push('$');
    regex_lite::Regex::new(&pattern).is_ok_and(|re| re.is_match(uri))
}

impl McpServer {
    fn listing(&self) -> Listing {
        self.listed.offered.held()
    }

    /// Its prompts, named as the kernel names them (prefixed).
    pub fn prompts(&self) -> Vec<Prompt> {
        let prefix = self.prefix();
        let mut prompts = self.listing().prompts;
        for prompt in &mut prompts {
            prompt.name = format!("{prefix}{}", prompt.name);
        }
        prompts
    }

    /// Its resources, by their URIs.
    pub fn resources(&self) -> Vec<Resource> {
        self.listing().resources
    }

    /// Its resource templates.
    pub fn templates(&self) -> Vec<ResourceTemplate> {
        self.listing().templates
    }

    /// Whether `uri` is one of its resources, or one its templates name.
    pub fn owns(&self, uri: &str) -> bool {
        let listing = self.listing();
        listing.resources.iter().any(|r| r.uri == uri)
            || listing
                .templates
                .iter()
                .any(|t| matches(&t.uri_template, uri))
    }

    /// The server's name of the kernel's prompt `name`.
    pub fn prompt_of(&self, name: &str) -> Option<String> {
        let prompt = name.strip_prefix(&self.prefix())?;
        let listing = self.listing();
        (listing.prompts.iter())
            .any(|p| p.name == prompt)
            .then(|| prompt.to_owned())
    }

    /// The resources the server says were updated, from now on.
    pub fn updates(&self) -> broadcast::Receiver<String> {
        self.listed.offered.updated.subscribe()
    }

    /// Watches `uri`: the first watch asks the server to say when it
    /// changes (`resources/subscribe`, where the server takes it), and
    /// dropping the last tells it to stop. What it says arrives on
    /// [`McpServer::updates`].
    pub async fn watch(self: &Arc<Self>, uri: &str) -> Result<ResourceWatch, ChainError> {
        let first = {
            let watched = self.listed.offered.watched.lock();
            let mut watched = watched.unwrap_or_else(PoisonError::into_inner);
            let count = watched.entry(uri.to_owned()).or_default();
            *count += 1;
            *count == 1
        };
        let watch = ResourceWatch {
            server: self.clone(),
            uri: uri.to_owned(),
        };
        if first && self.listing().subscribes {
            self.subscribe(uri, true).await?;
        }
        Ok(watch)
    }

    /// The server's prompt `prompt` with `arguments`: its
    /// `GetPromptResult`, as JSON.
    pub async fn get_prompt(&self, prompt: &str, arguments: Value) -> Result<Value, ChainError> {
        let params = json!({ "name": prompt, "arguments": arguments });
        let params = serde_json::from_value(params)
            .map_err(|e| self.error(ErrorKind::InvalidRequest, format!("prompts/get: {e}")))?;
        let got = self.ask("prompts/get", |peer| async move {
            peer.get_prompt(params).await
        });
        let result = got.await?;
        serde_json::to_value(result).map_err(|e| self.error(ErrorKind::Internal, e.to_string()))
    }

    /// The server's resource `uri`: its `ReadResourceResult`, as JSON.
    pub async fn read_resource(&self, uri: &str) -> Result<Value, ChainError> {
        let params = serde_json::from_value(json!({ "uri": uri }))
            .map_err(|e| self.error(ErrorKind::InvalidRequest, format!("resources/read: {e}")))?;
        let read = self.ask("resources/read", |peer| async move {
            peer.read_resource(params).await
        });
        let result = read.await?;
        serde_json::to_value(result).map_err(|e| self.error(ErrorKind::Internal, e.to_string()))
    }

    /// Asks the server to say when `uri` changes (`subscribe`), or to stop.
    #[allow(deprecated, reason = "servers of the 2025 protocols subscribe so")]
    async fn subscribe(&self, uri: &str, subscribe: bool) -> Result<(), ChainError> {
        let params = json!({ "uri": uri });
        let bad = |e: serde_json::Error| self.error(ErrorKind::InvalidRequest, e.to_string());
        if subscribe {
            let params = serde_json::from_value(params).map_err(bad)?;
            self.ask("resources/subscribe", |peer| async move {
                peer.subscribe(params).await
            })
            .await
        } else {
            let params = serde_json::from_value(params).map_err(bad)?;
            self.ask("resources/unsubscribe", |peer| async move {
                peer.unsubscribe(params).await
            })
            .await
        }
    }

    /// The server's completion of an argument of one of its prompts or
    /// templates (`params` naming it as the server does).
    pub async fn complete(
        &self,
        params: CompleteRequestParams,
    ) -> Result<CompleteResult, ChainError> {
        self.ask("completion/complete", |peer| async move {
            peer.complete(params).await
        })
        .await
    }

    /// `request` over the live connection within the call bound: a server
    /// that refuses it is `invalid-request`, one that fails the transport
    /// or runs past the bound is dropped, to be started again.
    async fn ask<T, F>(
        &self,
        what: &str,
        request: impl FnOnce(Peer<RoleClient>) -> F,
    ) -> Result<T, ChainError>
    where
        F: Future<Output = Result<T, ServiceError>>,
    {
        let connection = self.connection().await?;
        let peer = connection.session.peer().clone();
        let answered = tokio::time::timeout(super::timeout(&self.config), request(peer));
        match answered.await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(ServiceError::McpError(error))) => {
                Err(self.error(ErrorKind::InvalidRequest, error.message.into_owned()))
            }
            Ok(Err(error)) => {
                self.drop_connection(&connection).await;
                Err(self.error(ErrorKind::Transient, format!("{what} failed: {error}")))
            }
            Err(_) => {
                self.drop_connection(&connection).await;
                let message = format!("{what} took over {} ms", self.config.timeout_ms);
                Err(self.error(ErrorKind::Timeout, message))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn a_template_names_the_uris_its_variables_fill() {
        assert!(matches(
            "test://template/{id}/data",
            "test://template/123/data"
        ));
        assert!(!matches(
            "test://template/{id}/data",
            "test://template/1/2/data"
        ));
        assert!(!matches(
            "test://template/{id}/data",
            "test://template/123/datum"
        ));
        assert!(matches("file:///{+path}", "file:///a/b/c.txt"));
        assert!(matches("db://rows{?limit}", "db://rows?limit=3"));
        assert!(matches("db://rows{?limit}", "db://rows"));
        assert!(!matches("a.b://{x}", "aXb://y"), "literal text is literal");
        assert!(!matches("broken://{x", "broken://y"));
    }
}
