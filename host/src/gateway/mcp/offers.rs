//! What `/mcp` federates beside tools: the servers' prompts (named with
//! each server's prefix), resources and resource templates (by their
//! URIs), subscriptions to resources, and completion. A key sees only
//! the prompts its `prompts` patterns match and the resources (and
//! templates) its `resources` patterns match; the others do not exist for
//! it.
//!
//! A `prompts/get` and a `resources/read` run through the endpoint's tool
//! chain as requests of their kind (`tool-request.kind`), so a filter can
//! refuse or rewrite them as it does a tool call, and their output is
//! shown through the token transforms, so a redaction filter holds on a
//! prompt's messages and a resource's text. A listing, a subscription and
//! a completion are the servers' own answers: they name things, and run
//! no chain; a subscription and a completion ask a server, so they take a
//! place among the requests served at once, as a call does (a listing is
//! the gateway's own, from memory).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use rmcp::ErrorData;
use rmcp::model::{
    CompleteRequestParams, CompleteResult, GetPromptRequestParams, GetPromptResponse,
    GetPromptResult, ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Reference, ResultType,
};
use rmcp::service::{RequestContext, RoleServer};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::{Caller, Tools};
use crate::mcp::{McpServer, ResourceWatch};
use crate::onion::InvokeOptions;
use crate::types::{ChainError, ErrorKind};

/// The most resources one session may subscribe to at once.
pub(super) const SUBSCRIPTIONS_CAP: usize = 64;

/// A session's subscriptions, by URI: each a relay of the server's
/// updates to the session, which ends (and lets the server stop) when it
/// is dropped.
#[derive(Default)]
pub(super) struct Subscriptions(Mutex<HashMap<String, Relay>>);

struct Relay {
    task: JoinHandle<()>,
    _watch: ResourceWatch,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn servers(caller: &Caller) -> &[Arc<McpServer>] {
    caller.endpoint.kernel.mcp_servers()
}

fn may_prompt(caller: &Caller, name: &str) -> bool {
    caller.key.as_ref().is_none_or(|key| key.may_prompt(name))
}

fn may_read(caller: &Caller, uri: &str) -> bool {
    caller.key.as_ref().is_none_or(|key| key.may_read(uri))
}

/// The server that owns `uri`, if the caller may read it.
fn owner<'a>(caller: &'a Caller, uri: &str) -> Option<&'a Arc<McpServer>> {
    let owner = servers(caller).iter().find(|server| server.owns(uri));
    owner.filter(|_| may_read(caller, uri))
}

fn unknown(what: &str, name: &str) -> ErrorData {
    let name = crate::escape::terminal_line(name);
    ErrorData::invalid_params(format!("unknown {what} '{name}'"), None)
}

/// A chain's error as the client is told it: what it got wrong as invalid
/// parameters, anything else as an internal error, its kind in `data`.
fn refused(error: &ChainError) -> ErrorData {
    let data = Some(json!({ "kind": error.kind.as_str() }));
    match error.kind {
        ErrorKind::InvalidRequest | ErrorKind::NotFound => {
            ErrorData::invalid_params(error.message.clone(), data)
        }
        _ => ErrorData::internal_error(error.message.clone(), data),
    }
}

/// The chain's output as `T` (a prompt's or a resource's result), or the
/// refusal a filter answered with (`{"error": {...}}`).
fn answered<T: DeserializeOwned>(output: &str, what: &str) -> Result<T, ErrorData> {
    let value: Value = serde_json::from_str(output)
        .map_err(|e| ErrorData::internal_error(format!("{what} is not JSON: {e}"), None))?;
    if let Some(error) = value.get("error").filter(|e| e.is_object()) {
        let message = error["message"].as_str().unwrap_or("refused by a filter");
        return Err(ErrorData::invalid_request(
            message.to_owned(),
            Some(error.clone()),
        ));
    }
    serde_json::from_value(value).map_err(|e| {
        ErrorData::internal_error(format!("{what}, after the filters, is not one: {e}"), None)
    })
}

impl Tools {
    pub(super) fn prompts(
        context: &RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        let caller = Self::caller(context)?;
        let prompts = servers(&caller)
            .iter()
            .flat_map(|server| server.prompts())
            .filter(|prompt| may_prompt(&caller, &prompt.name))
            .collect();
        Ok(ListPromptsResult::with_all_items(prompts))
    }

    pub(super) fn resources(
        context: &RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let caller = Self::caller(context)?;
        // A URI two servers list is the first's (it reads it).
        let mut listed = HashSet::new();
        let resources = servers(&caller)
            .iter()
            .flat_map(|server| server.resources())
            .filter(|resource| may_read(&caller, &resource.uri))
            .filter(|resource| listed.insert(resource.uri.clone()))
            .collect();
        Ok(ListResourcesResult::with_all_items(resources))
    }

    pub(super) fn templates(
        context: &RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        let caller = Self::caller(context)?;
        let templates = servers(&caller)
            .iter()
            .flat_map(|server| server.templates())
            .filter(|template| may_read(&caller, &template.uri_template))
            .collect();
        Ok(ListResourceTemplatesResult::with_all_items(templates))
    }

    /// A `prompts/get`, through the tool chain.
    pub(super) async fn prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        let caller = Self::caller(&context)?;
        let name = request.name;
        let offered = servers(&caller)
            .iter()
            .any(|s| s.prompt_of(&name).is_some());
        if !offered || !may_prompt(&caller, &name) {
            self.shared.metrics.mcp_call("", "refused");
            return Err(unknown("prompt", &name));
        }
        let arguments = request.arguments.map_or_else(|| json!({}), Value::Object);
        let kernel = caller.endpoint.kernel.clone();
        let get = |options: InvokeOptions| async move {
            Ok(kernel
                .prompt(&name, arguments, options.shown())
                .await?
                .output)
        };
        let output = self.bounded(&caller, &context, "the prompt", get).await;
        let output = output.map_err(|error| refused(&error))?;
        let mut result: GetPromptResult = answered(&output, "the prompt")?;
        // Complete, as this gateway says it to each peer (the SDK drops it
        // for one of an older protocol), whatever the server's protocol.
        result.result_type = Some(ResultType::COMPLETE);
        Ok(GetPromptResponse::Complete(result))
    }

    /// A `resources/read`, through the tool chain.
    pub(super) async fn read(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let caller = Self::caller(&context)?;
        let uri = request.uri;
        if owner(&caller, &uri).is_none() {
            self.shared.metrics.mcp_call("", "refused");
            return Err(ErrorData::resource_not_found(
                format!("unknown resource '{}'", crate::escape::terminal_line(&uri)),
                None,
            ));
        }
        let kernel = caller.endpoint.kernel.clone();
        let read = |options: InvokeOptions| async move {
            Ok(kernel.read_resource(&uri, options.shown()).await?.output)
        };
        let output = self.bounded(&caller, &context, "the read", read).await;
        let output = output.map_err(|error| refused(&error))?;
        let mut result: ReadResourceResult = answered(&output, "the resource")?;
        result.result_type = Some(ResultType::COMPLETE);
        Ok(ReadResourceResponse::Complete(result))
    }

    /// A `resources/subscribe`: the owner is asked to say when `uri`
    /// changes, and what it says is relayed to this session, until it
    /// unsubscribes or goes.
    pub(super) async fn subscribe(
        &self,
        uri: String,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let caller = Self::caller(&context)?;
        let Some(server) = owner(&caller, &uri).cloned() else {
            return Err(unknown("resource", &uri));
        };
        {
            let held = self
                .subscriptions
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if held.contains_key(&uri) {
                return Ok(());
            }
            if held.len() >= SUBSCRIPTIONS_CAP {
                return Err(ErrorData::invalid_request(
                    format!("a session subscribes to at most {SUBSCRIPTIONS_CAP} resources"),
                    None,
                ));
            }
        }
        let mut updates = server.updates();
        // Asking the server is work: it takes a place, as a call does.
        let watching = |_: InvokeOptions| async { server.watch(&uri).await };
        let watch = self
            .bounded(&caller, &context, "the subscription", watching)
            .await;
        let watch = watch.map_err(|error| refused(&error))?;
        let (peer, watched) = (context.peer.clone(), uri.clone());
        let task = tokio::spawn(async move {
            loop {
                match updates.recv().await {
                    Ok(updated) if updated == watched => {
                        let param = rmcp::model::ResourceUpdatedNotificationParam::new(updated);
                        let told = peer.notify_resource_updated(param);
                        if !matches!(
                            tokio::time::timeout(super::told::NOTICE, told).await,
                            Ok(Ok(()))
                        ) {
                            return;
                        }
                    }
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => return,
                }
            }
        });
        let relay = Relay {
            task,
            _watch: watch,
        };
        let mut held = self
            .subscriptions
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        held.insert(uri, relay);
        Ok(())
    }

    /// A `resources/unsubscribe`: the relay ends; the server is told once
    /// no session watches the resource.
    pub(super) fn unsubscribe(&self, uri: &str) {
        let relay = self
            .subscriptions
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uri);
        drop(relay);
    }

    /// A `completion/complete`, by the server whose prompt or template it
    /// names (as that server names it).
    pub(super) async fn complete(
        &self,
        mut request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        let caller = Self::caller(&context)?;
        let server = match &mut request.r#ref {
            Reference::Prompt(prompt) => {
                let found = (servers(&caller).iter())
                    .find_map(|server| Some((server, server.prompt_of(&prompt.name)?)));
                match found.filter(|_| may_prompt(&caller, &prompt.name)) {
                    Some((server, named)) => {
                        prompt.name = named;
                        server.clone()
                    }
                    None => return Err(unknown("prompt", &prompt.name)),
                }
            }
            Reference::Resource(template) => {
                let found = servers(&caller).iter().find(|server| {
                    (server.templates().iter()).any(|t| t.uri_template == template.uri)
                });
                match found.filter(|_| may_read(&caller, &template.uri)) {
                    Some(server) => server.clone(),
                    None => return Err(unknown("resource template", &template.uri)),
                }
            }
            _ => {
                return Err(ErrorData::invalid_params(
                    "an unknown kind of reference",
                    None,
                ));
            }
        };
        // Asking the server is work: it takes a place, as a call does.
        let completing = |_: InvokeOptions| async move { server.complete(request).await };
        let completed = self
            .bounded(&caller, &context, "the completion", completing)
            .await;
        let mut result = completed.map_err(|error| refused(&error))?;
        // Complete, as this gateway says it to each peer (the SDK drops it
        // for one of an older protocol), whatever the server's protocol.
        result.result_type = Some(ResultType::COMPLETE);
        Ok(result)
    }
}
