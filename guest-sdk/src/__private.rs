//! Glue between the [`Filter`] trait and the generated bindings. Used by the
//! code `#[shallot_guest::filter]` emits; not part of the API.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::OnceLock;

pub use serde;
pub use wit_bindgen;

pub use crate::bindings::__export_filter_world as export_world;
use crate::bindings::exports::shallot::filter::{
    chat_filter, plugin, system_prompt_filter, token_filter, tool_filter, turn_filter,
};
use crate::bindings::shallot::filter::types::{
    ChatRequest, FilterError as WitError, TokenBatch, ToolRequest, TurnRequest,
    TurnResult as WitTurnResult,
};
use crate::{ChatResponse, ToolResponse};
use crate::{Filter, FilterError, Hook, Next, TokenOut, TokenTransform, Tokens, next};

/// What the attribute knows about the filter type it was put on.
pub trait Export: Filter {
    const NAME: &'static str;
    const VERSION: &'static str;
    const HOOKS: &'static [Hook];
    /// The configured filter of this instance.
    fn slot() -> &'static OnceLock<Self>;
}

/// Implements every exported interface for the filter `F`.
pub struct Adapter<F>(PhantomData<F>);

fn configured<F: Export>() -> &'static F {
    F::slot()
        .get()
        .expect("the shallot host calls `configure` before any hook")
}

fn parse_config<F: Export>(config: &str) -> Result<F, String> {
    match serde_json::from_str(config) {
        Ok(filter) => Ok(filter),
        // No configuration: let a struct whose fields all have defaults
        // stand in for `null`.
        Err(_) if config.trim() == "null" => {
            serde_json::from_str("{}").map_err(|e| format!("configuration required: {e}"))
        }
        Err(e) => Err(format!("invalid configuration: {e}")),
    }
}

/// A panic, said the way the host reports it: where and what, without
/// advice about environment variables a sandboxed filter cannot set.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        match info.location() {
            Some(at) => eprintln!("panicked at {}:{}: {message}", at.file(), at.line()),
            None => eprintln!("panicked: {message}"),
        }
    }));
}

impl<F: Export> plugin::Guest for Adapter<F> {
    fn configure(config: String) -> Result<(), String> {
        quiet_panics();
        let mut filter = parse_config::<F>(&config)?;
        filter.configure()?;
        F::slot()
            .set(filter)
            .map_err(|_| "configure called twice".to_owned())
    }

    fn describe() -> plugin::Descriptor {
        let filter = configured::<F>();
        let init = filter.init();
        plugin::Descriptor {
            name: F::NAME.to_owned(),
            version: F::VERSION.to_owned(),
            init_fctx: serde_json::to_string(&init)
                .unwrap_or_else(|e| panic!("FCtx init does not serialize: {e}")),
            hooks: F::HOOKS
                .iter()
                .copied()
                .filter(|&hook| filter.wants(hook))
                .collect(),
        }
    }
}

impl<F: Export> chat_filter::Guest for Adapter<F> {
    fn around_chat(request: &ChatRequest) -> Result<ChatResponse, WitError> {
        next::begin_hook();
        configured::<F>()
            .around_chat(request, Next::new())
            .map_err(FilterError::returned)
    }
}

impl<F: Export> tool_filter::Guest for Adapter<F> {
    fn around_tool(request: &ToolRequest) -> Result<ToolResponse, WitError> {
        next::begin_hook();
        configured::<F>()
            .around_tool(request, Next::new())
            .map_err(FilterError::returned)
    }
}

impl<F: Export> turn_filter::Guest for Adapter<F> {
    fn around_turn(request: &TurnRequest) -> WitTurnResult {
        next::begin_hook();
        configured::<F>()
            .around_turn(request, Next::new())
            .returned()
    }
}

impl<F: Export> system_prompt_filter::Guest for Adapter<F> {
    fn system_prompt(prompt: String) -> Result<String, WitError> {
        next::begin_hook();
        configured::<F>()
            .system_prompt(prompt)
            .map_err(FilterError::returned)
    }
}

impl<F: Export> token_filter::Guest for Adapter<F> {
    type TokenTransformer = Transformer<F>;
}

/// One stream's transform, owned by the host through a resource handle.
pub struct Transformer<F> {
    inner: RefCell<Box<dyn TokenTransform>>,
    filter: PhantomData<F>,
}

impl<F: Export> token_filter::GuestTokenTransformer for Transformer<F> {
    fn new() -> Self {
        Transformer {
            inner: RefCell::new(configured::<F>().token_transform()),
            filter: PhantomData,
        }
    }

    fn step(&self, tokens: TokenBatch) -> Result<TokenBatch, WitError> {
        let mut out = TokenOut::default();
        self.inner
            .borrow_mut()
            .step(Tokens::new(tokens), &mut out)
            .map_err(FilterError::returned)?;
        Ok(out.into_batch())
    }

    fn flush(&self) -> Result<TokenBatch, WitError> {
        let mut out = TokenOut::default();
        self.inner
            .borrow_mut()
            .flush(crate::tokens::stream_end(), &mut out)
            .map_err(FilterError::returned)?;
        Ok(out.into_batch())
    }
}
