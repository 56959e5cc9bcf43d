use std::sync::Arc;

use super::ToolCall;
use serde::{Deserialize, Serialize};

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: serde_json::Value,
    /// The tool has effects that need approval.
    #[serde(default)]
    pub sensitive: bool,
    /// Host-side: a batch of tool calls that includes this tool runs one
    /// call at a time rather than concurrently.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub serial: bool,
    /// Host-side: when every call of a batch is to such tools and none
    /// fails, their outputs are the turn's final answer (no model round).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub return_direct: bool,
    /// Host-side: a native call that takes longer fails with a `timeout`
    /// error. `None` (the default): nothing stops a slow tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Host-side: how often a native call that failed with a `transient` or
    /// `timeout` error is tried again. Other errors are never retried.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retries: u32,
    /// Host-side: asks an OpenAI-compatible model to keep its calls to
    /// exactly `parameters` (the wire's `function.strict`, structured
    /// outputs); the model server decides what schemas it accepts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub strict: bool,
    /// Host-side: a question for a human, not code. Calling it pauses the
    /// turn ([`crate::types::InterruptKind::ToolRequest`], the call's
    /// arguments being the question), and the reply the turn is resumed
    /// with ([`crate::types::Decision::Reply`]) is its result. Registered
    /// with `KernelBuilder::interrupt_tool`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interrupt: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ToolSpec {
    /// A tool taking an object described by `parameters`.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: serde_json::Value,
    ) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters,
            sensitive: false,
            serial: false,
            return_direct: false,
            timeout_ms: None,
            retries: 0,
            strict: false,
            interrupt: false,
        }
    }

    /// Marks the tool sensitive.
    pub fn sensitive(mut self) -> Self {
        self.sensitive = true;
        self
    }

    /// This tool with the host-side fields of `earlier` (the same tool as
    /// the host had it): what a filter rewrites through the contract, which
    /// has no words for them, keeps them.
    pub(crate) fn keeping_host_side(self, earlier: &ToolSpec) -> ToolSpec {
        ToolSpec {
            serial: earlier.serial,
            return_direct: earlier.return_direct,
            timeout_ms: earlier.timeout_ms,
            retries: earlier.retries,
            strict: earlier.strict,
            interrupt: earlier.interrupt,
            ..self
        }
    }

    /// Asks the model to follow `parameters` exactly (see [`ToolSpec::strict`]).
    pub fn strict(mut self) -> Self {
        self.strict = true;
        self
    }

    /// Makes calling the tool pause the turn for a human's reply (see
    /// [`ToolSpec::interrupt`]).
    pub fn interrupt(mut self) -> Self {
        self.interrupt = true;
        self
    }

    /// Makes a batch that calls this tool run sequentially.
    pub fn serial(mut self) -> Self {
        self.serial = true;
        self
    }

    /// Makes the tool's output the turn's answer (see [`ToolSpec::return_direct`]).
    pub fn return_direct(mut self) -> Self {
        self.return_direct = true;
        self
    }

    /// Bounds each native call of the tool (see [`ToolSpec::timeout_ms`]).
    pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout_ms = Some(timeout.as_millis().try_into().unwrap_or(u64::MAX));
        self
    }

    /// Retries transient failures of the tool (see [`ToolSpec::retries`]).
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }
}

/// What a tool chain's call is: a tool's, or a prompt or a resource an
/// MCP server offers, which pass the same filters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolKind {
    /// A tool called.
    #[default]
    Call,
    /// A prompt got: its name the prompt's, its arguments the prompt's, its
    /// output the server's `GetPromptResult` as JSON.
    Prompt,
    /// A resource read: its name the URI, its arguments `{"uri": ...}`,
    /// its output the server's `ReadResourceResult` as JSON.
    Resource,
}

/// One tool execution: what the tool chain carries inward.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// The tool called.
    pub tool: Arc<ToolSpec>,
    /// The id of the model's tool call; empty for a direct invoke.
    pub call_id: Arc<str>,
    /// The arguments, a JSON object as text.
    pub arguments: Arc<str>,
    /// The tool calls of the model's round this call belongs to, in the
    /// model's order, this one among them; empty for a direct invoke. A
    /// filter decides on the whole batch from any of its calls.
    pub batch: Arc<[ToolCall]>,
    /// What it is: a tool's call, a prompt's or a resource's.
    pub kind: ToolKind,
}

impl ToolRequest {
    /// A request to run `tool` with `arguments` (JSON text).
    pub fn new(tool: Arc<ToolSpec>, arguments: impl Into<Arc<str>>) -> Self {
        ToolRequest {
            tool,
            call_id: Arc::from(""),
            arguments: arguments.into(),
            batch: Arc::from([]),
            kind: ToolKind::Call,
        }
    }

    /// The request as one of `kind`.
    pub fn of_kind(mut self, kind: ToolKind) -> Self {
        self.kind = kind;
        self
    }
}

/// A tool's result: what the tool chain carries outward.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResponse {
    /// The result as JSON text; it goes back to the model as the tool message.
    pub output: String,
}

impl ToolResponse {
    /// A result from any serializable value.
    pub fn json(value: &impl Serialize) -> Self {
        // Serializing a `Serialize` value into a String only fails for maps
        // with non-string keys; tools return plain JSON data.
        ToolResponse {
            output: serde_json::to_string(value)
                .unwrap_or_else(|e| format!("{{\"error\":{:?}}}", e.to_string())),
        }
    }

    /// The result parsed as JSON.
    pub fn value(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_str(&self.output)
    }
}
