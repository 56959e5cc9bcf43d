//! A server's questions during a `tools/call`, relayed to the `/mcp`
//! client that made the call: a `sampling/createMessage` and an
//! `elicitation/create` go to it (on the call's own stream, as the
//! protocol has it) when it said, as it opened its session, that it
//! answers them; otherwise the server is told no one can, never answered
//! on the client's behalf. What the server logs during the call goes to
//! the client too, at or above the level the client set
//! (`logging/setLevel`; every level until it sets one). What the server
//! says in them (an elicitation's message, a sampling's texts, a log
//! line) is shown through the endpoint's token transforms first, as every
//! text the gateway shows, so a redaction holds on what a person or a
//! model is asked or told.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use rmcp::model::{ClientCapabilities, ElicitRequestParams};
use rmcp::service::{Peer, RoleServer};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::context::{Asker, Context};
use crate::kernel::Kernel;

/// The `/mcp` client of a call, as the server's questions and log lines
/// reach it, and the endpoint whose token transforms show them.
pub(super) struct Client {
    peer: Peer<RoleServer>,
    samples: bool,
    elicits: bool,
    shown: (Kernel, Context),
    /// The least level of log line its session takes.
    level: Arc<AtomicU8>,
    /// The log lines on their way to it, in order (at most [`WAITING`]:
    /// past them a line is dropped, so a server that floods holds back
    /// nothing).
    lines: mpsc::Sender<Value>,
}

/// How many log lines wait for a client at most.
const WAITING: usize = 64;

/// The levels of a log line, least first, as the protocol names them.
pub(super) const LEVELS: [&str; 8] = [
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];

/// The rank of the level `named` (an unknown one: the least).
pub(super) fn rank(named: &str) -> u8 {
    LEVELS.iter().position(|level| *level == named).unwrap_or(0) as u8
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
    /// The client behind `peer`, its questions and log lines shown through
    /// `kernel`'s token transforms (for the invoke of `context`), its log
    /// lines at `level` or above.
    pub(super) fn of(
        peer: &Peer<RoleServer>,
        (kernel, context): (&Kernel, &Context),
        level: Arc<AtomicU8>,
    ) -> Client {
        let capabilities: Option<ClientCapabilities> =
            peer.peer_info().map(|info| info.capabilities.clone());
        let capabilities = capabilities.unwrap_or_default();
        #[allow(deprecated, reason = "clients of the 2025 protocols answer sampling")]
        let samples = capabilities.sampling.is_some();
        let elicits = capabilities.elicitation.is_some();
        let (lines, waiting) = mpsc::channel(WAITING);
        let shown = (kernel.clone(), context.clone());
        tokio::spawn(tell(peer.clone(), shown.clone(), waiting));
        Client {
            peer: peer.clone(),
            samples,
            elicits,
            shown,
            level,
            lines,
        }
    }

    async fn shown(&self, text: Option<&mut Value>) -> Result<(), String> {
        shown(&self.shown, text).await
    }
}

/// `text`, if it is one, as the token transforms of `kernel` show it.
async fn shown(
    (kernel, context): &(Kernel, Context),
    text: Option<&mut Value>,
) -> Result<(), String> {
    let Some(text) = text else {
        return Ok(());
    };
    let Some(said) = text.as_str() else {
        return Ok(());
    };
    let shown = kernel.delivered_text(said, context.clone()).await;
    *text = Value::String(shown.map_err(|e| format!("showing the question: {}", e.message))?);
    Ok(())
}

/// Tells `peer` the log lines that arrive, in order, each its data as
/// text shown through the token transforms, each within the notice bound;
/// ends with the call (when every sender is gone) or a client that does
/// not read.
async fn tell(
    peer: Peer<RoleServer>,
    through: (Kernel, Context),
    mut lines: mpsc::Receiver<Value>,
) {
    while let Some(mut params) = lines.recv().await {
        let data = match params.get("data") {
            Some(Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => continue,
        };
        let mut data = Value::String(data);
        if shown(&through, Some(&mut data)).await.is_err() {
            continue;
        }
        params["data"] = data;
        let Ok(params) = serde_json::from_value(params) else {
            continue;
        };
        #[allow(deprecated, reason = "clients of the 2025 protocols take log lines")]
        let told = peer.notify_logging_message(params);
        if !matches!(
            tokio::time::timeout(super::told::NOTICE, told).await,
            Ok(Ok(()))
        ) {
            return;
        }
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

    fn log(&self, params: Value) {
        let level = rank(params["level"].as_str().unwrap_or_default());
        if level >= self.level.load(Ordering::Relaxed) {
            let _ = self.lines.try_send(params);
        }
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
