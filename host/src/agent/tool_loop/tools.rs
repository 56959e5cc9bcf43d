//! One round of the loop: the model call, then its tool calls (their specs
//! looked up, run through the tool chain as a batch, concurrent unless
//! configured otherwise, under the batch's deadline, outputs in call
//! order); and the round that goes on with a paused turn.

use std::collections::HashMap;
use std::sync::Arc;

use super::run::Run;
use super::{Paused, Ran, ToolLoop, spec_of};
use crate::onion::Invoke;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, Decision, ErrorKind, Origin, ToolCall, ToolKind,
    ToolRequest, ToolSpec, TurnResult, Weigh,
};

impl ToolLoop {
    /// The tool requests of `calls`, of the round whose calls are
    /// `batch`: each with its spec, registered or offered, or the error of
    /// a tool that is neither.
    fn requests(
        &self,
        tools: &[Arc<ToolSpec>],
        offered: &[ToolSpec],
        calls: &[ToolCall],
        batch: &Arc<[ToolCall]>,
    ) -> Vec<Result<ToolRequest, ChainError>> {
        // Each name is looked up once a batch: an offered spec is copied
        // out of the request, and a batch may call one tool many times.
        let mut specs: HashMap<&str, Option<Arc<ToolSpec>>> = HashMap::new();
        calls
            .iter()
            .map(|call| {
                let spec = specs.entry(call.name.as_str()).or_insert_with(|| {
                    spec_of(tools, &call.name)
                        .cloned()
                        .or_else(|| {
                            let spec = offered.iter().find(|tool| tool.name == call.name)?;
                            Some(Arc::new(spec.clone()))
                        })
                        .map(|spec| self.bounded(spec))
                });
                match spec.clone() {
                    Some(tool) => Ok(ToolRequest {
                        tool,
                        call_id: Arc::from(call.id.as_str()),
                        arguments: Arc::from(call.arguments.as_str()),
                        batch: batch.clone(),
                        kind: ToolKind::Call,
                    }),
                    None => Err(ChainError::new(
                        ErrorKind::NotFound,
                        format!("tool '{}' is not registered", call.name),
                    )),
                }
            })
            .collect()
    }

    /// Runs a batch of tool calls through the tool chain: concurrently
    /// unless configured otherwise or a tool in it is `serial`. Outputs in
    /// call order. A tool that is not registered but was offered to the
    /// model (a chat filter added it, as `tool-search` adds its search
    /// tool) goes through the tool chain for a filter to serve, the
    /// registry answering `not-found` if none does; a call of a tool
    /// neither registered nor offered fails without running filters.
    pub(super) async fn run_tools(
        &self,
        run: &Run<'_>,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        offered: &[ToolSpec],
        calls: &[ToolCall],
    ) -> Vec<Result<String, ChainError>> {
        let requests = self.requests(tools, offered, calls, &run.batch());
        let serial = !self.config.parallel_tools
            || requests.iter().flatten().any(|request| request.tool.serial);
        let runnable: Vec<ToolRequest> = requests.iter().flatten().cloned().collect();
        let count = runnable.len();
        let batch = async {
            if serial || count < 2 {
                invoke.tool_series(runnable).await
            } else {
                invoke.tool_batch(runnable).await
            }
        };
        let outputs = match self.config.batch_timeout {
            None => batch.await,
            Some(limit) => tokio::time::timeout(limit, batch)
                .await
                .unwrap_or_else(|_| {
                    let ms = limit.as_millis();
                    let message =
                        format!("the batch of {count} tool calls did not finish within {ms} ms");
                    let late = ChainError::new(ErrorKind::Timeout, message)
                        .at(Origin::terminal("tool-loop"));
                    vec![Err(late); count]
                }),
        };
        let mut outputs = outputs.into_iter();
        requests
            .into_iter()
            .map(|request| match request {
                Ok(_) => outputs
                    .next()
                    .expect("one output per runnable call")
                    .map(|r| r.output),
                Err(error) => Err(error),
            })
            .collect()
    }
}

impl ToolLoop {
    /// Goes on with a paused turn: its held calls run, are denied or get
    /// the human's reply, as `decision` says, then the calls the pause
    /// left for later. `Some` when the turn ends (or pauses again) there.
    pub(super) async fn go_on(
        &self,
        run: &mut Run<'_>,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        paused: &Paused,
        decision: Decision,
    ) -> Option<TurnResult> {
        let pending = paused.pending.clone();
        let outcomes = match decision {
            Decision::Approve => {
                let offered = run.offered.clone().unwrap_or_default();
                self.run_tools(run, invoke, tools, &offered, &pending).await
            }
            Decision::Deny(reason) => pending.iter().map(|_| Err(denied(&reason))).collect(),
            Decision::Reply(text) => {
                let reply = serde_json::Value::String(text).to_string();
                pending.iter().map(|_| Ok(reply.clone())).collect()
            }
        };
        let ran = Ran {
            calls: pending,
            outcomes,
        };
        let later = paused.later.clone();
        let waiting = !later.is_empty();
        if let Some(end) = self.conclude(run, tools, ran, vec![], None, later.clone()) {
            return Some(end);
        }
        if waiting {
            return self.batch(run, invoke, tools, later).await;
        }
        None
    }

    /// One model round: the chat chain over the run's messages, then the
    /// tool calls it asked for. `Some` when the turn ends in it: the model
    /// answered, or the turn failed or paused.
    pub(super) async fn round(
        &self,
        run: &mut Run<'_>,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        offered: &Arc<Vec<ToolSpec>>,
        round: u32,
    ) -> Option<Ended> {
        let chat = ChatRequest {
            messages: Arc::new(run.messages.clone()),
            tools: offered.clone(),
            ..Default::default()
        };
        let (response, reached) = invoke.chat_reaching(chat).await;
        if let Some(reached) = reached {
            run.offered = Some(reached.tools);
        }
        let response = match response {
            Ok(response) => response,
            Err(error) => return Some(Ended::Turn(TurnResult::Error(error))),
        };
        // A filter may answer in the model's place: its answer is
        // bounded as the model's is before its calls run.
        let calls = response.message.tool_calls.len();
        let limits = invoke.onion().response_limits;
        if let Err(error) = limits.check_as("tool-loop", calls, response.weight()) {
            return Some(Ended::Turn(TurnResult::Error(error)));
        }
        run.rounds = round;
        run.push(response.message.clone());
        let calls = response.message.tool_calls.clone();
        run.last = Some(response.clone());
        if calls.is_empty() {
            return Some(Ended::Answered(response));
        }
        run.begin_batch();
        self.batch(run, invoke, tools, calls).await.map(Ended::Turn)
    }
}

/// How a round ended the turn.
pub(super) enum Ended {
    /// The model answered without tool calls.
    Answered(ChatResponse),
    /// The turn failed, stopped or paused.
    Turn(TurnResult),
}

/// A tool call a human (or policy) refused, as the model sees it.
fn denied(reason: &str) -> ChainError {
    ChainError::new(
        ErrorKind::InvalidRequest,
        format!("the call was denied: {reason}"),
    )
    .at(Origin::terminal("tool-loop"))
}
