//! The `model` import (`grants.model`): side calls to a model the kernel
//! names, outside the onion. Bounded per hook call in calls and tokens,
//! by what the host sends, never by what the filter asks: a side call is
//! a request the host builds from the filter's messages, tools and an
//! allow-list of options ([`SideOptions`]: nothing that multiplies or
//! hides its cost), its prompt charged before it leaves (estimated, a
//! token per four bytes), its worst case reserved for each attempt (a
//! retry, another upstream of a pool) and settled at what it cost. The
//! wait is not the filter's own time, and the invoke's deadline bounds
//! it; each attempt is also one request of the invoke's tree.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::json;
use wasmtime::component::Resource;

use super::HostState;
use super::service::{AROUND, GrantedServices, Service, Spent, error};
use crate::context::Tokens;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::bindings::shallot::filter::{model, model_stream};
use crate::plugin::convert;
use crate::types::{Call, ChatRequest, ChatResponse, JsonMap, ModelOptions};

/// The `model` grant: which model a filter may call aside, by the name the
/// kernel gives it (`default`: the model behind the filter's chain, its
/// route's upstream in `shallot serve`; `embedded`: the embedded model),
/// and how much one hook call may ask of it. Written `model = "default"`
/// or `model = { name = "default", calls = 4, tokens = 8192 }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ModelForm")]
pub struct ModelGrant {
    /// The model's name.
    pub name: String,
    /// Side calls one hook call may make.
    pub calls: u32,
    /// Tokens (the prompts, as estimated before they leave, and the
    /// answers, as the model reports them) the side calls of one hook call
    /// may spend in all.
    pub tokens: u32,
}

impl ModelGrant {
    /// Side calls per hook call unless the operator says otherwise.
    pub const CALLS: u32 = 4;
    /// Tokens per hook call unless the operator says otherwise.
    pub const TOKENS: u32 = 8192;

    /// A grant of the model `name`, with the default bounds.
    pub fn of(name: impl Into<String>) -> Self {
        ModelGrant {
            name: name.into(),
            calls: Self::CALLS,
            tokens: Self::TOKENS,
        }
    }
}

/// The two ways an operator writes a `model` grant.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a model's name (\"default\", \"embedded\") or a table { name = \"...\", calls = 4, tokens = 8192 }"
)]
enum ModelForm {
    Name(String),
    Table(ModelTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelTable {
    name: String,
    #[serde(default = "calls")]
    calls: u32,
    #[serde(default = "tokens")]
    tokens: u32,
}

fn calls() -> u32 {
    ModelGrant::CALLS
}

fn tokens() -> u32 {
    ModelGrant::TOKENS
}

impl From<ModelForm> for ModelGrant {
    fn from(form: ModelForm) -> Self {
        match form {
            ModelForm::Name(name) => ModelGrant::of(name),
            ModelForm::Table(ModelTable {
                name,
                calls,
                tokens,
            }) => ModelGrant {
                name,
                calls,
                tokens,
            },
        }
    }
}

/// The `model` service: what a side call spends, the host builds, charges
/// and settles (see the module's documentation).
pub(crate) struct Model;

/// What a call's side calls spent: calls, and tokens.
#[derive(Default)]
pub(crate) struct SideCalls {
    calls: u32,
    tokens: u32,
}

impl Service for Model {
    const IMPORT: &'static str = "model";
    const CALLED: &'static str = "model.complete";
    const CALLS: &'static [Call] = AROUND;
    const GRANT: &'static str = "model = \"default\"";
    type Granted = ModelGrant;
    type Spent = SideCalls;

    fn granted(services: &GrantedServices) -> Option<&ModelGrant> {
        services.model.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut SideCalls {
        &mut spent.model
    }
}

impl model_stream::Host for HostState {
    fn end(&mut self) -> wasmtime::Result<Option<wit::FinishReason>> {
        Ok(self.stream_end)
    }
}

/// The options a side call may carry: what shapes an answer. Anything
/// else (`stream`, which fails the call after the model spent its tokens;
/// `n` past 1, answers paid for and never read; `service_tier`, `model`,
/// `user`, audio, predictions) is refused, naming it. The options the host
/// sends, `max_tokens` at most `most`.
fn side_options(asked: &ModelOptions, most: u64) -> Result<ModelOptions, String> {
    for (key, value) in &asked.extra {
        match key.as_str() {
            "n" if value.as_u64() == Some(1) => {}
            "n" => {
                return Err(format!(
                    "a side call answers once: `n` must be 1, not {value}"
                ));
            }
            "stream" if value == &json!(false) => {}
            "stream" => return Err("a side call is never streamed: `stream` must be false".into()),
            _ => return Err(format!("unknown field `{key}`")),
        }
    }
    for (key, set) in [
        ("model", asked.model.is_some()),
        ("user", asked.user.is_some()),
    ] {
        if set {
            return Err(format!("unknown field `{key}`"));
        }
    }
    if asked
        .stop
        .as_ref()
        .is_some_and(|stop| stop.texts().len() > 4)
    {
        return Err("a side call stops at no more than 4 texts".into());
    }
    Ok(ModelOptions {
        max_tokens: Some(most),
        max_completion_tokens: None,
        extra: JsonMap::new(),
        ..asked.clone()
    })
}

/// About how many tokens `request` is to a model: a token per four bytes
/// of what it sends (every message's text and tool calls, every tool's
/// name, description and schema), and four for each message's framing.
fn prompt_tokens(request: &ChatRequest) -> u64 {
    let bytes: usize = request
        .messages
        .iter()
        .map(|message| {
            let calls: usize = message
                .tool_calls
                .iter()
                .map(|call| call.name.len() + call.arguments.len())
                .sum();
            message.text().len() + calls + 16
        })
        .sum::<usize>()
        + request
            .tools
            .iter()
            .map(|tool| {
                tool.name.len() + tool.description.len() + tool.parameters.to_string().len()
            })
            .sum::<usize>();
    (bytes as u64).div_ceil(4)
}

/// What an answer cost: what the model says, else estimated as a prompt
/// is (its text and tool calls, a token per four bytes).
fn cost(request: &ChatRequest, response: &ChatResponse) -> u64 {
    let usage = &response.usage;
    let reported = u64::from(usage.input_tokens) + u64::from(usage.output_tokens);
    if reported > 0 {
        return reported;
    }
    let message = &response.message;
    let calls: usize = message
        .tool_calls
        .iter()
        .map(|call| call.name.len() + call.arguments.len())
        .sum();
    prompt_tokens(request) + ((message.text().len() + calls) as u64).div_ceil(4)
}

/// The request a side call sends for what the filter `asked`, with `left`
/// of the grant's `tokens` to spend: its options read through the
/// allow-list and its answer capped at what is left after its prompt.
/// The request, its prompt's estimate and the most its answer may take.
fn side_request(
    asked: &ChatRequest,
    left: u64,
    tokens: u32,
) -> Result<(ChatRequest, u64, u64), wit::FilterError> {
    let prompt = prompt_tokens(asked);
    if prompt >= left {
        let message = format!(
            "a side call's prompt of about {prompt} tokens does not fit in the {left} its grant has left in this call (of {tokens})"
        );
        return Err(error(wit::ErrorKind::LimitExceeded, message));
    }
    let most = asked
        .options
        .longest()
        .map_or(left - prompt, |asked| asked.min(left - prompt));
    let sent = side_options(&asked.options, most).map_err(|e| {
        let message = format!("a side call's options: {e}");
        error(wit::ErrorKind::InvalidRequest, message)
    })?;
    let request = ChatRequest {
        options: Arc::new(sent),
        ..asked.clone()
    };
    Ok((request, prompt, most))
}

impl model::Host for HostState {
    async fn complete(
        &mut self,
        request: Resource<ChatRequest>,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        let grant = match self.admit::<Model>() {
            Ok(grant) => grant,
            Err(refused) => return Ok(Err(refused)),
        };
        let spent = self.spent::<Model>();
        if spent.calls >= grant.calls {
            let message = format!("more than {} model side calls in one call", grant.calls);
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let left = u64::from(grant.tokens.saturating_sub(spent.tokens));
        let Some(scope) = &self.scope else {
            return Ok(Err(error(
                wit::ErrorKind::InvalidRequest,
                "model.complete called outside a hook",
            )));
        };
        let invoke = scope.invoke.clone();
        let Some(side) = invoke.onion().side_models.get(&grant.name).cloned() else {
            let message = format!(
                "this host has no model named `{}` for side calls",
                grant.name
            );
            return Ok(Err(error(wit::ErrorKind::InvalidRequest, message)));
        };
        let asked = self.table.get(&request)?;
        let (request, prompt, most) = match side_request(asked, left, grant.tokens) {
            Ok(built) => built,
            Err(refused) => return Ok(Err(refused)),
        };
        self.spent::<Model>().calls += 1;
        let tokens = Arc::new(Tokens::new(left, prompt, most));
        let context = invoke.context().with_tokens(tokens.clone());
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let answer = side.side_chat(request.clone(), &invoke, &context).await;
        meter.leave_next();
        match &answer {
            Ok(response) => tokens.answered(cost(&request, response)),
            Err(_) => tokens.abandoned(),
        }
        let spent = u32::try_from(tokens.spent()).unwrap_or(u32::MAX);
        let side = self.spent::<Model>();
        side.tokens = side.tokens.saturating_add(spent.max(1));
        match answer {
            Ok(response) => self.hand_over(response),
            Err(failure) => Ok(Err(convert::filter_error(&failure))),
        }
    }
}
