//! Native tools: async Rust functions the tool chain's terminal runs, each
//! with a JSON Schema its arguments are checked against before it is called.
//! `builtin` has the demo tools (calculator, clock, echo).
//!
//! A call runs under its tool's optional timeout and is retried, as the tool
//! asks, when it fails with a `transient` or `timeout` error; a handler that
//! panics fails its own call with an `internal` error and nothing else.

pub mod builtin;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;

use crate::context::Context;
use crate::onion::Invoke;
use crate::onion::{Terminal, Tool};
use crate::types::{ChainError, ErrorKind};
use crate::types::{ToolKind, ToolRequest, ToolResponse, ToolSpec};

type Handler =
    Arc<dyn Fn(Value, Context) -> BoxFuture<'static, Result<Value, ChainError>> + Send + Sync>;

struct Registered {
    spec: Arc<ToolSpec>,
    handler: Handler,
    /// The compiled argument schema, or why the schema does not compile.
    schema: Result<jsonschema::Validator, String>,
}

/// The tools a kernel can run, by name; and what else its tool chain
/// runs: prompts by name, and resources by who reads their URIs.
#[derive(Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Registered>,
    prompts: BTreeMap<String, Registered>,
    readers: Vec<Reader>,
}

/// Who reads the resources whose URIs `owns` says yes to.
struct Reader {
    owns: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    registered: Registered,
}

/// What a resource read's request is: a URI, which a filter may rewrite.
fn resource_spec(uri: &str) -> ToolSpec {
    let schema = serde_json::json!({
        "type": "object",
        "properties": { "uri": { "type": "string" } },
        "required": ["uri"],
    });
    ToolSpec::new(uri, "a resource read", schema)
}

impl ToolRegistry {
    /// Registers `handler` as the tool `spec` describes, replacing any tool
    /// of the same name. The handler gets the arguments object and the
    /// invoke's shared context.
    pub fn register<F, Fut>(&mut self, spec: ToolSpec, handler: F)
    where
        F: Fn(Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ChainError>> + Send + 'static,
    {
        let registered = Registered::new(spec, handler);
        self.tools.insert(registered.spec.name.clone(), registered);
    }

    /// Registers `handler` as the prompt `spec` describes (its arguments
    /// as the schema's properties), replacing any of the same name.
    pub fn register_prompt<F, Fut>(&mut self, spec: ToolSpec, handler: F)
    where
        F: Fn(Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ChainError>> + Send + 'static,
    {
        let registered = Registered::new(spec, handler);
        self.prompts
            .insert(registered.spec.name.clone(), registered);
    }

    /// Registers `handler` as the reader of the resources whose URIs
    /// `owns` says yes to; it is given `{"uri": ...}`. The first reader
    /// that owns a URI reads it.
    pub fn register_reader<F, Fut>(
        &mut self,
        owns: impl Fn(&str) -> bool + Send + Sync + 'static,
        handler: F,
    ) where
        F: Fn(Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ChainError>> + Send + 'static,
    {
        self.readers.push(Reader {
            owns: Arc::new(owns),
            registered: Registered::new(resource_spec(""), handler),
        });
    }

    /// The spec of the prompt `name`.
    pub fn prompt_spec(&self, name: &str) -> Option<Arc<ToolSpec>> {
        self.prompts.get(name).map(|prompt| prompt.spec.clone())
    }

    /// The request's spec for a read of `uri`, if a reader owns it.
    pub fn resource_spec(&self, uri: &str) -> Option<Arc<ToolSpec>> {
        self.reader(uri).map(|_| Arc::new(resource_spec(uri)))
    }

    fn reader(&self, uri: &str) -> Option<&Registered> {
        let reader = self.readers.iter().find(|reader| (reader.owns)(uri));
        reader.map(|reader| &reader.registered)
    }

    /// The first tool whose parameter schema does not compile, and why.
    pub fn schema_error(&self) -> Option<(String, String)> {
        (self.tools.iter().chain(&self.prompts)).find_map(|(name, tool)| {
            tool.schema
                .as_ref()
                .err()
                .map(|e| (name.clone(), e.clone()))
        })
    }

    /// The spec of the tool `name`.
    pub fn spec(&self, name: &str) -> Option<Arc<ToolSpec>> {
        self.tools.get(name).map(|tool| tool.spec.clone())
    }

    /// Every tool's spec, by name, shared.
    pub(crate) fn shared_specs(&self) -> Vec<Arc<ToolSpec>> {
        self.tools.values().map(|tool| tool.spec.clone()).collect()
    }

    /// Every tool's spec, by name.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools
            .values()
            .map(|tool| (*tool.spec).clone())
            .collect()
    }
}

#[async_trait]
impl Terminal<Tool> for ToolRegistry {
    async fn call(
        &self,
        request: ToolRequest,
        _: &Arc<Invoke>,
        context: &Context,
    ) -> Result<ToolResponse, ChainError> {
        let name = &request.tool.name;
        let arguments: Value = serde_json::from_str(&request.arguments).map_err(|e| {
            ChainError::new(
                ErrorKind::InvalidRequest,
                format!("tool '{name}': arguments are not JSON: {e}"),
            )
        })?;
        let found = match request.kind {
            ToolKind::Call => self.tools.get(name),
            ToolKind::Prompt => self.prompts.get(name),
            ToolKind::Resource => arguments["uri"].as_str().and_then(|uri| self.reader(uri)),
        };
        let tool = found.ok_or_else(|| {
            let what = match request.kind {
                ToolKind::Call => "tool",
                ToolKind::Prompt => "prompt",
                ToolKind::Resource => "resource",
            };
            ChainError::new(
                ErrorKind::NotFound,
                format!("{what} '{name}' is not registered"),
            )
        })?;
        if let Ok(schema) = &tool.schema {
            // The first few: each quotes the value it is about, and
            // arguments a filter rewrote can fail a schema everywhere.
            let problems: Vec<String> = schema
                .iter_errors(&arguments)
                .take(8)
                .map(|e| match e.instance_path().as_str() {
                    "" => format!("#: {e}"),
                    path => format!("{path}: {e}"),
                })
                .collect();
            if !problems.is_empty() {
                let message = format!(
                    "tool '{name}': the arguments do not match its schema: {}",
                    problems.join("; ")
                );
                return Err(ChainError::new(ErrorKind::InvalidRequest, message));
            }
        }
        let mut tries = 0;
        loop {
            let within = request.tool.timeout_ms;
            match tool.run(arguments.clone(), context.clone(), within).await {
                Ok(output) => return Ok(ToolResponse::json(&output)),
                Err(e)
                    if tries < tool.spec.retries
                        && matches!(e.kind, ErrorKind::Transient | ErrorKind::Timeout) =>
                {
                    tries += 1;
                    tracing::debug!(tool = %name, tries, error = %e, "retrying the tool");
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Registered {
    fn new<F, Fut>(spec: ToolSpec, handler: F) -> Self
    where
        F: Fn(Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ChainError>> + Send + 'static,
    {
        let handler: Handler =
            Arc::new(move |arguments, context| Box::pin(handler(arguments, context)));
        let schema = jsonschema::validator_for(&spec.parameters).map_err(|e| e.to_string());
        Registered {
            spec: Arc::new(spec),
            handler,
            schema,
        }
    }

    /// One call of the handler, bounded by `timeout_ms` (the tool's, or
    /// the tool loop's default for tools that set none), with a panic
    /// turned into an error.
    async fn run(
        &self,
        arguments: Value,
        context: Context,
        timeout_ms: Option<u64>,
    ) -> Result<Value, ChainError> {
        let name = &self.spec.name;
        let call = AssertUnwindSafe((self.handler)(arguments, context)).catch_unwind();
        let outcome = match timeout_ms {
            Some(ms) => tokio::time::timeout(Duration::from_millis(ms), call)
                .await
                .map_err(|_| {
                    ChainError::new(
                        ErrorKind::Timeout,
                        format!("tool '{name}' did not finish within {ms} ms"),
                    )
                })?,
            None => call.await,
        };
        outcome.unwrap_or_else(|panic| {
            let said = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(ChainError::new(
                ErrorKind::Internal,
                format!("tool '{name}' panicked: {said}"),
            ))
        })
    }
}
