//! Building a kernel: its filters in order, its model, tools, turn
//! terminal and approver, checked and composed once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::Kernel;
use crate::agent::ToolLoop;
use crate::context::{Context, Reducers};
use crate::engine::Engine;
use crate::mcp::McpServer;
use crate::model::{ChatModel, EmbeddedModel, ModelTerminal, ResponseLimits};
use crate::onion::{Approver, Chat, Filter, KernelFilter, Onion, SideModel, Terminal, Tool, Turn};
use crate::plugin::{self, FilterSet, WasmFilter};
use crate::tool::ToolRegistry;
use crate::types::{ChainError, ErrorKind, ToolSpec};

/// Why a kernel could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Two filters have the same name (it keys their private state).
    #[error("two filters are named '{0}'; filter names key private state and must be unique")]
    DuplicateName(String),
    /// The wasm filters were loaded with different engines.
    #[error("the wasm filters come from different engines; load every plugin with one `Engine`")]
    MixedEngines,
    /// One invoke could need more instances than the engine has slots.
    #[error(
        "one invoke can need {need} instance slots but the engine has {have}; raise `EngineConfig::instance_slots`"
    )]
    TooFewSlots {
        /// Instances one invoke can need.
        need: usize,
        /// The engine's slots.
        have: u32,
    },
    /// One invoke could need more instances of a filter than its quota.
    #[error(
        "one invoke can need {need} instances of filter '{filter}' but its limits allow {have}; raise its `instances` limit"
    )]
    TooFewInstances {
        /// The filter.
        filter: String,
        /// Its instances one invoke can need.
        need: usize,
        /// Its `instances` limit.
        have: u32,
    },
    /// A tool's parameters are not a valid JSON Schema.
    #[error("tool '{tool}': its parameters are not a valid JSON Schema: {message}")]
    ToolSchema {
        /// The tool.
        tool: String,
        /// The schema compiler's words.
        message: String,
    },
    /// An MCP server's tool has the name of a tool registered before it
    /// (a native one or another server's): one would hide the other.
    #[error(
        "the tool '{tool}' of the MCP server '{server}' has the name of a tool the kernel already has; give the server another `prefix`"
    )]
    ToolClash {
        /// The tool's name in the kernel.
        tool: String,
        /// The server whose tool it is.
        server: String,
    },
    /// An MCP server's prompt has the name of another server's prompt
    /// (both prefixed): one would hide the other.
    #[error(
        "the prompt '{prompt}' of the MCP server '{server}' has the name of another server's prompt; give the server another `prefix`"
    )]
    PromptClash {
        /// The prompt's name in the kernel.
        prompt: String,
        /// The server registered second.
        server: String,
    },
}

/// Builds a [`Kernel`].
#[derive(Default)]
pub struct KernelBuilder {
    filters: Vec<KernelFilter>,
    /// By position in `filters`: the wasm filter, `None` for a native one.
    wasm: Vec<Option<Arc<WasmFilter>>>,
    model: Option<Arc<dyn ChatModel>>,
    response_limits: ResponseLimits,
    tools: ToolRegistry,
    turn: Option<Arc<dyn Terminal<Turn>>>,
    approver: Option<Arc<dyn Approver>>,
    side_models: HashMap<String, Arc<dyn ChatModel>>,
    reducers: Reducers,
    /// The first MCP tool registered over another tool: `(tool, server)`.
    clash: Option<(String, String)>,
    /// The first prompt named as another server's.
    prompt_clash: Option<BuildError>,
    /// The MCP servers, in the order registered.
    servers: Vec<Arc<McpServer>>,
}

impl KernelBuilder {
    /// Appends the filters of `plugins`, in order.
    pub fn plugins(mut self, plugins: &FilterSet) -> Self {
        for filter in plugins.filters() {
            self = self.wasm(filter.clone());
        }
        self
    }

    /// Appends one wasm filter.
    pub fn wasm(mut self, filter: Arc<WasmFilter>) -> Self {
        self.filters.push(KernelFilter {
            name: filter.name().into(),
            hooks: filter.hooks().to_vec(),
            init: filter.init_fctx().clone(),
            filter: filter.clone(),
        });
        self.wasm.push(Some(filter));
        self
    }

    /// Appends a native (Rust) filter.
    pub fn filter(mut self, filter: impl Filter) -> Self {
        let filter: Arc<dyn Filter> = Arc::new(filter);
        self.filters.push(KernelFilter {
            name: filter.name().into(),
            hooks: filter.hooks().to_vec(),
            init: filter.init_fctx(),
            filter,
        });
        self.wasm.push(None);
        self
    }

    /// The model at the core of the chat chain (default: [`EmbeddedModel`]).
    pub fn model(mut self, model: impl ChatModel) -> Self {
        self.model = Some(Arc::new(model));
        self
    }

    /// A model filters may call aside under `name` (their `grants.model`),
    /// besides `default` (the model of [`KernelBuilder::model`]) and
    /// `embedded` (the embedded model), which a name given here replaces.
    /// A side call goes to the model directly: no filter sees it and it is
    /// never streamed to the caller.
    pub fn side_model(mut self, name: impl Into<String>, model: impl ChatModel) -> Self {
        self.side_models.insert(name.into(), Arc::new(model));
        self
    }

    /// Bounds on each model answer (default: [`ResponseLimits::default`]).
    pub fn response_limits(mut self, limits: ResponseLimits) -> Self {
        self.response_limits = limits;
        self
    }

    /// Registers a native tool.
    pub fn tool<F, Fut>(mut self, spec: ToolSpec, handler: F) -> Self
    where
        F: Fn(serde_json::Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<serde_json::Value, ChainError>> + Send + 'static,
    {
        self.tools.register(spec, handler);
        self
    }

    /// Registers an interrupt tool: a
    /// question the model may put to a human, such as `ask_human`. Calling
    /// it pauses the turn in the tool loop
    /// ([`InterruptKind::ToolRequest`](crate::types::InterruptKind), the
    /// call's arguments being the question), and `Kernel::resume` with
    /// [`Decision::Reply`](crate::types::Decision) gives the model the
    /// reply as its result. It has no code: approved, or called outside
    /// the tool loop, it fails.
    pub fn interrupt_tool(mut self, spec: ToolSpec) -> Self {
        let message = format!(
            "tool '{}' is a question for a human: the tool loop pauses the turn for it, and a reply (Decision::Reply) answers it",
            spec.name
        );
        self.tools.register(spec.interrupt(), move |_, _| {
            let error = ChainError::new(ErrorKind::InvalidRequest, message.clone());
            async move { Err(error) }
        });
        self
    }

    /// Declares a reducer for the shared-context key `key`: the writes the tool calls of one batch make to it are
    /// folded into its value in call order, `reduce(value, write)`, from
    /// `init` when it is absent, instead of the last writer by call index
    /// winning. A reducer that prepends keeps every call's note, one that
    /// adds keeps a running total.
    pub fn reducer(
        mut self,
        key: impl Into<String>,
        init: serde_json::Value,
        reduce: impl Fn(serde_json::Value, serde_json::Value) -> serde_json::Value
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.reducers = std::mem::take(&mut self.reducers).with(key, init, reduce);
        self
    }

    /// Registers the tools of a started MCP server (`server.tools()`,
    /// prefixed): each call goes through the tool chain, then to the
    /// server. A tool whose name the kernel already has (a native tool's,
    /// another server's) makes [`KernelBuilder::build`] fail with
    /// [`BuildError::ToolClash`]; register native tools first.
    pub fn mcp(mut self, server: &Arc<McpServer>) -> Self {
        for spec in server.tools() {
            let Some(tool) = server.tool_of(&spec.name) else {
                continue;
            };
            if self.clash.is_none() && self.tools.spec(&spec.name).is_some() {
                self.clash = Some((spec.name.clone(), server.name().to_owned()));
            }
            let server = server.clone();
            self.tools
                .register(spec, move |arguments, context: Context| {
                    let (server, tool) = (server.clone(), tool.clone());
                    async move { server.call_for(&tool, arguments, &context).await }
                });
        }
        self.offers(server)
    }

    /// Registers a server's prompts and its resources' reader: each
    /// `prompts/get` and `resources/read` goes through the tool chain (a
    /// request of its kind), then to the server.
    fn offers(mut self, server: &Arc<McpServer>) -> Self {
        for prompt in server.prompts() {
            let Some(named) = server.prompt_of(&prompt.name) else {
                continue;
            };
            if self.tools.prompt_spec(&prompt.name).is_some() {
                self.prompt_clash.get_or_insert(BuildError::PromptClash {
                    prompt: prompt.name.clone(),
                    server: server.name().to_owned(),
                });
            }
            let server = server.clone();
            self.tools
                .register_prompt(prompt_spec(&prompt), move |arguments, _| {
                    let (server, named) = (server.clone(), named.clone());
                    async move { server.get_prompt(&named, arguments).await }
                });
        }
        // URIs are the servers' own, not prefixed: where two list one, the
        // first registered reads it (as it lists it).
        for resource in server.resources() {
            if self.tools.resource_spec(&resource.uri).is_some() {
                tracing::warn!(
                    server = %server.name(),
                    "the resource '{}' is another MCP server's too: that one reads it",
                    crate::escape::terminal_line(&resource.uri)
                );
            }
        }
        let (owner, reader) = (server.clone(), server.clone());
        self.tools.register_reader(
            move |uri| owner.owns(uri),
            move |arguments, _| {
                let reader = reader.clone();
                async move {
                    let uri = arguments["uri"].as_str().unwrap_or_default();
                    reader.read_resource(uri).await
                }
            },
        );
        self.servers.push(server.clone());
        self
    }

    /// Registers the built-in demo tools (calculator, clock, echo).
    pub fn builtin_tools(mut self) -> Self {
        crate::tool::builtin::register(&mut self.tools);
        self
    }

    /// The terminal of the turn chain (default: a [`ToolLoop`] with its
    /// default limits and in-memory history).
    pub fn turn_terminal(mut self, terminal: impl Terminal<Turn>) -> Self {
        self.turn = Some(Arc::new(terminal));
        self
    }

    /// Who answers filters granted the `approval` import (such as the
    /// built-in `approval` filter's `ask` rules). Without one, every
    /// question is answered no.
    pub fn approver(mut self, approver: impl Approver) -> Self {
        self.approver = Some(Arc::new(approver));
        self
    }

    /// Composes the onions.
    pub fn build(self) -> Result<Kernel, BuildError> {
        let mut names = HashSet::new();
        for entry in &self.filters {
            if !names.insert(entry.name.clone()) {
                return Err(BuildError::DuplicateName(entry.name.to_string()));
            }
        }
        self.check_instances()?;
        if let Some((tool, server)) = self.clash {
            return Err(BuildError::ToolClash { tool, server });
        }
        if let Some(clash) = self.prompt_clash {
            return Err(clash);
        }
        if let Some((tool, message)) = self.tools.schema_error() {
            return Err(BuildError::ToolSchema { tool, message });
        }
        let model = self.model.unwrap_or_else(|| Arc::new(EmbeddedModel::new()));
        let tools = Arc::new(self.tools);
        let turn = self.turn.unwrap_or_else(|| Arc::new(ToolLoop::default()));
        let chat = Arc::new(ModelTerminal {
            model: model.clone(),
            limits: self.response_limits,
        });
        let terminal = |model| -> Arc<dyn SideModel> {
            Arc::new(ModelTerminal {
                model,
                limits: self.response_limits,
            })
        };
        let mut side_models: HashMap<String, Arc<dyn SideModel>> = HashMap::from([
            ("default".to_owned(), chat.clone() as Arc<dyn SideModel>),
            (
                "embedded".to_owned(),
                terminal(Arc::new(EmbeddedModel::new())),
            ),
        ]);
        for (name, model) in self.side_models {
            side_models.insert(name, terminal(model));
        }
        let mut onion = Onion::compose(
            self.filters,
            chat,
            tools.clone(),
            turn,
            tools.shared_specs(),
        );
        onion.approver = self.approver;
        onion.side_models = side_models;
        onion.response_limits = self.response_limits;
        onion.reducers = self.reducers;
        Ok(Kernel {
            onion: Arc::new(onion),
            wasm: self.wasm.into(),
            tools,
            model,
            servers: self.servers.into(),
        })
    }

    /// Whether every invoke can be admitted: the wasm filters share one
    /// engine, each has the instances it may need at once, and the engine
    /// has slots for all of them.
    fn check_instances(&self) -> Result<(), BuildError> {
        let mut engine: Option<Engine> = None;
        for filter in self.wasm.iter().flatten() {
            match &engine {
                None => engine = Some(filter.engine().clone()),
                Some(ours) if !ours.same(filter.engine()) => {
                    return Err(BuildError::MixedEngines);
                }
                Some(_) => {}
            }
        }
        if let Some(engine) = &engine {
            let mut total = 0;
            let starts = [
                plugin::need::<Chat>,
                plugin::need::<Tool>,
                plugin::need::<Turn>,
            ];
            for need_in in starts {
                let mut sum = 0;
                for filter in self.wasm.iter().flatten() {
                    let need = need_in(filter.hooks(), true, true);
                    let have = filter.limits().instances;
                    if need > have as usize {
                        return Err(BuildError::TooFewInstances {
                            filter: filter.name().to_owned(),
                            need,
                            have,
                        });
                    }
                    sum += need;
                }
                total = total.max(sum);
            }
            if total > engine.slot_count() as usize {
                return Err(BuildError::TooFewSlots {
                    need: total,
                    have: engine.slot_count(),
                });
            }
        }
        Ok(())
    }
}

/// A prompt as the tool chain sees it: its arguments are the properties
/// of an object of strings, those it requires required.
fn prompt_spec(prompt: &rmcp::model::Prompt) -> ToolSpec {
    let arguments = prompt.arguments.as_deref().unwrap_or_default();
    let properties: serde_json::Map<String, serde_json::Value> = arguments
        .iter()
        .map(|argument| {
            let mut property = serde_json::json!({ "type": "string" });
            if let Some(description) = &argument.description {
                property["description"] = description.clone().into();
            }
            (argument.name.clone(), property)
        })
        .collect();
    let required: Vec<&str> = arguments
        .iter()
        .filter(|argument| argument.required == Some(true))
        .map(|argument| argument.name.as_str())
        .collect();
    let schema =
        serde_json::json!({ "type": "object", "properties": properties, "required": required });
    ToolSpec::new(
        &prompt.name,
        prompt.description.as_deref().unwrap_or_default(),
        schema,
    )
}
