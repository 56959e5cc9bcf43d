//! A server's questions during a `tools/call`, relayed to the `/mcp`
//! client that made the call: a `sampling/createMessage` and an
//! `elicitation/create` go to it (on the call's own stream, as the
//! protocol has it) when it said, as it opened its session, that it
//! answers them; otherwise the server is told no one can, never answered
//! on the client's behalf. What the server says in them (an elicitation's
//! message, a sampling's texts) is shown through the endpoint's token
//! transforms first, as every text the gateway shows, so a redaction
//! holds on what a person or a model is asked.

use rmcp::model::{ClientCapabilities, ElicitRequestParams};
use rmcp::service::{Peer, RoleServer};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::context::{Asker, Context};
use crate::kernel::Kernel;

/// The `/mcp` client of a call, as the server's questions reach it, and
/// the endpoint whose token transforms show them.
pub(super) struct Client {
    peer: Peer<RoleServer>,
    samples: bool,
    elicits: bool,
    shown: (Kernel, Context),
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("samples", &self.samples)
            .field("elicits", &self.elicits)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// The client behind `peer`, if it answers either question, its
    /// questions shown through `kernel`'s token transforms (for the invoke
    /// of `context`).
    pub(super) fn of(
        peer: &Peer<RoleServer>,
        kernel: &Kernel,
        context: &Context,
    ) -> Option<Client> {
        let capabilities: Option<ClientCapabilities> =
            peer.peer_info().map(|info| info.capabilities.clone());
        let capabilities = capabilities.unwrap_or_default();
        #[allow(deprecated, reason = "clients of the 2025 protocols answer sampling")]
        let samples = capabilities.sampling.is_some();
        let elicits = capabilities.elicitation.is_some();
        (samples || elicits).then(|| Client {
            peer: peer.clone(),
            samples,
            elicits,
            shown: (kernel.clone(), context.clone()),
        })
    }

    /// `text`, if it is one, as the token transforms show it.
    async fn shown(&self, text: Option<&mut Value>) -> Result<(), String> {
        let Some(text) = text else {
            return Ok(());
        };
        let Some(said) = text.as_str() else {
            return Ok(());
        };
        let (kernel, context) = &self.shown;
        let shown = kernel.delivered_text(said, context.clone()).await;
        *text = Value::String(shown.map_err(|e| format!("showing the question: {}", e.message))?);
        Ok(())
    }
}

fn parsed<T: DeserializeOwned>(params: Value) -> Result<T, String> {
    serde_json::from_value(params).map_err(|e| format!("the server's question: {e}"))
}

fn answered(
    answer: Result<impl serde::Serialize, rmcp::service::ServiceError>,
) -> Result<Value, String> {
    let answer = answer.map_err(|e| format!("the client did not answer: {e}"))?;
    serde_json::to_value(answer).map_err(|e| e.to_string())
}

#[async_trait::async_trait]
impl Asker for Client {
    #[allow(deprecated, reason = "servers of the 2025 protocols ask for sampling")]
    async fn sample(&self, params: Value) -> Result<Value, String> {
        if !self.samples {
            return Err("the client of this call does not answer sampling".to_owned());
        }
        let mut params = params;
        if let Some(messages) = params["messages"].as_array_mut() {
            for message in messages {
                let text = message.get_mut("content").and_then(|c| c.get_mut("text"));
                self.shown(text).await?;
            }
        }
        self.shown(params.get_mut("systemPrompt")).await?;
        answered(self.peer.create_message(parsed(params)?).await)
    }

    async fn elicit(&self, params: Value) -> Result<Value, String> {
        if !self.elicits {
            return Err("the client of this call does not answer elicitation".to_owned());
        }
        let mut params = params;
        self.shown(params.get_mut("message")).await?;
        let params: ElicitRequestParams = parsed(params)?;
        answered(self.peer.create_elicitation(params).await)
    }
}
