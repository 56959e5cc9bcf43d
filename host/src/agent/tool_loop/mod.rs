//! The tool loop: the turn chain's terminal.
//!
//! The turn request carries the turn's new messages; with `load_history`
//! the loop puts the conversation's stored history before them. Each round
//! calls the chat chain, runs the tool calls the model asked for through the
//! tool chain (a batch concurrently, results in call order), appends the
//! assistant and tool messages, and goes again until the model answers
//! without tool calls. The done result carries the final response, the tool
//! calls made, the number of model rounds and the run's whole message
//! sequence, so a turn filter can re-enter with `messages = run messages +
//! feedback, load_history = false`.
//!
//! `run` is one turn's state as it goes (messages, calls, rounds, how it
//! ends); `tools` runs one round (the model call and its batch of tool
//! calls) and the round that goes on with a paused turn; this file is the
//! loop around them.

mod run;
mod tools;

use self::tools::Ended;

use self::run::Run;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::history::{History, MemoryHistory};
use crate::context::{CONVERSATION_ID, Context};
use crate::onion::Invoke;
use crate::onion::{Terminal, Turn};
use crate::types::{ChainError, ErrorKind, Origin};
use crate::types::{
    ChatResponse, InterruptKind, Message, ToolCall, ToolCallRecord, ToolSpec, TurnRequest,
    TurnResult,
};

/// Limits and behaviour of the tool loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopConfig {
    /// Model rounds before the turn stops with a `limit-exceeded` error.
    pub max_iterations: u32,
    /// Tool calls before the turn stops with a `limit-exceeded` error
    /// (`None`, no limit, by default: the turn is bounded
    /// by `max_iterations` rounds of at most one answer's calls each, see
    /// [`crate::ResponseLimits`]); checked before each round, so the last
    /// batch can go past it by at most one answer's calls.
    pub max_tool_calls: Option<u32>,
    /// Run a batch of tool calls concurrently, unless a tool in it is
    /// `serial`.
    pub parallel_tools: bool,
    /// Pause the turn before running a `sensitive` tool: the turn ends with
    /// an interrupt naming the call, and `Kernel::resume` continues it with
    /// an approval or a denial (which the model gets as the tool result).
    pub pause_sensitive: bool,
    /// What a tool call that failed for its environment (an `auth` error:
    /// credentials, permissions) does to the turn.
    pub on_env_error: OnEnvError,
    /// The bound on each native tool call whose spec sets none: past it the call fails with a `timeout`
    /// error. A tool's own `timeout_ms` wins, `Duration::MAX` meaning
    /// never. `None` (the default): nothing stops a slow tool.
    pub tool_timeout: Option<Duration>,
    /// The bound on a whole batch of tool calls:
    /// past it every call of the batch fails with a `timeout` error and
    /// none of their writes are kept. `None` by default.
    pub batch_timeout: Option<Duration>,
    /// Refuse a call to a tool the model was not offered in that round
    /// (the list as the chat filters left it, `tool-search`'s trimming
    /// included): the model gets an `invalid-request` error for it and the
    /// tool never runs. Off by default, as in the seed: a registered tool
    /// the model names runs whether it was offered or not, so trimming the
    /// menu is a hint to the model, not access control. On, it is.
    pub offered_only: bool,
    /// End the turn when every call of a round's batch was refused (by
    /// `approval` or `tool-guard`, a filter's `content-filtered` error, a
    /// human's or the policy's denial on resume, or `offered_only`),
    /// instead of asking the model again (AgentScope's `StopOnAllDenied`):
    /// the turn is done, its answer saying what was refused, its finish
    /// reason `content-filtered` and its metadata `"stopped":
    /// "all_denied"`. Off by default.
    pub stop_on_all_denied: bool,
}

/// What a tool call that failed for its environment does to the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnEnvError {
    /// `Pause` when a human is in the loop (an interrupt tool
    /// is registered, the loop has an `on_tool_call` policy, or
    /// `pause_sensitive`), `Proceed` otherwise.
    #[default]
    Auto,
    /// The model gets the error, like any other.
    Proceed,
    /// The turn pauses ([`InterruptKind::EnvRetry`]) before the batch's
    /// results reach the model: fix the environment, then
    /// [`Decision::Approve`](crate::types::Decision::Approve) runs the failed calls again.
    Pause,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig {
            max_iterations: 10,
            max_tool_calls: None,
            parallel_tools: true,
            pause_sensitive: false,
            on_env_error: OnEnvError::Auto,
            tool_timeout: None,
            batch_timeout: None,
            offered_only: false,
            stop_on_all_denied: false,
        }
    }
}

/// Asked about each tool call before it runs: `Some(reason)` holds it.
type Policy = dyn Fn(&ToolCall) -> Option<String> + Send + Sync;

/// The tool loop, with the history it keeps conversations in.
pub struct ToolLoop {
    config: LoopConfig,
    history: Arc<dyn History>,
    on_tool_call: Option<Arc<Policy>>,
}

impl Default for ToolLoop {
    fn default() -> Self {
        Self::new(LoopConfig::default(), MemoryHistory::default())
    }
}

impl ToolLoop {
    /// A loop with `config`, keeping conversations in `history`.
    pub fn new(config: LoopConfig, history: impl History) -> Self {
        ToolLoop {
            config,
            history: Arc::new(history),
            on_tool_call: None,
        }
    }

    /// Asks `policy` about every tool call before it runs, once a call: `Some(reason)` holds the call and
    /// pauses the turn ([`InterruptKind::Callback`], with `reason`) for
    /// `Kernel::resume` to decide. The batch's other calls run first; of
    /// the calls the policy holds in one batch the first waits and the
    /// others are skipped (the model gets an error saying so). A policy
    /// that panics is logged and the call goes on.
    pub fn on_tool_call(
        mut self,
        policy: impl Fn(&ToolCall) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.on_tool_call = Some(Arc::new(policy));
        self
    }

    /// `spec` with the loop's default timeout, if it sets none.
    fn bounded(&self, spec: Arc<ToolSpec>) -> Arc<ToolSpec> {
        match (spec.timeout_ms, self.config.tool_timeout) {
            (None, Some(default)) => Arc::new((*spec).clone().timeout(default)),
            _ => spec,
        }
    }

    /// Whether a call that failed for its environment pauses the turn.
    fn pauses_on_env_error(&self, tools: &[Arc<ToolSpec>]) -> bool {
        match self.config.on_env_error {
            OnEnvError::Pause => true,
            OnEnvError::Proceed => false,
            OnEnvError::Auto => {
                self.config.pause_sensitive
                    || self.on_tool_call.is_some()
                    || tools.iter().any(|t| t.interrupt)
            }
        }
    }

    /// Sorts a batch's calls: those that run now, those skipped, the group
    /// that waits for a decision now (the first call of an interrupt tool,
    /// else the policy's first hold, else the sensitive calls), and those
    /// that wait for a decision after it.
    fn triage(&self, run: &mut Run<'_>, tools: &[Arc<ToolSpec>], calls: Vec<ToolCall>) -> Triage {
        let is = |call: &ToolCall, flag: fn(&ToolSpec) -> bool| {
            spec_of(tools, &call.name).is_some_and(|t| flag(t))
        };
        let (mut free, mut skipped, mut asks, mut sensitive) = (vec![], vec![], vec![], vec![]);
        let mut flagged: Option<(ToolCall, String)> = None;
        for call in calls {
            if is(&call, |t| t.interrupt) {
                asks.push(call);
            } else if let Some(reason) = self.verdict(run, &call) {
                match flagged {
                    None => flagged = Some((call, reason)),
                    Some(_) => skipped.push(call),
                }
            } else if self.config.pause_sensitive && is(&call, |t| t.sensitive) {
                sensitive.push(call);
            } else {
                free.push(call);
            }
        }
        let (hold, later) = if !asks.is_empty() {
            // One question at a time: each gets its own reply.
            let mut asks = asks.into_iter();
            let first = asks.next().expect("not empty");
            let reason = format!("tool '{}' asks for a reply", first.name);
            let flagged = flagged.map(|(call, _)| call);
            let later = asks.chain(flagged).chain(sensitive);
            let hold = Hold {
                kind: InterruptKind::ToolRequest,
                reason,
                calls: vec![first],
            };
            (Some(hold), later.collect())
        } else if let Some((call, reason)) = flagged {
            let hold = Hold {
                kind: InterruptKind::Callback,
                reason,
                calls: vec![call],
            };
            (Some(hold), sensitive)
        } else if !sensitive.is_empty() {
            let hold = Hold {
                kind: InterruptKind::Approval,
                reason: format!("tool '{}' needs approval", sensitive[0].name),
                calls: sensitive,
            };
            (Some(hold), Vec::new())
        } else {
            (None, Vec::new())
        };
        Triage {
            free,
            skipped,
            hold,
            later,
        }
    }

    /// The policy's verdict on `call`: asked once, kept for the run (a
    /// call it held is sorted again when the turn resumes).
    fn verdict(&self, run: &mut Run<'_>, call: &ToolCall) -> Option<String> {
        let policy = self.on_tool_call.as_ref()?;
        if let Some((_, verdict)) = run.verdicts.iter().find(|(c, _)| c == call) {
            return verdict.clone();
        }
        let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| policy(call)));
        let verdict = asked.unwrap_or_else(|_| {
            tracing::warn!(tool = %call.name, "the on_tool_call policy panicked; the call goes on");
            None
        });
        run.verdicts.push((call.clone(), verdict.clone()));
        verdict
    }

    /// Runs a batch of the model's calls and concludes it: `Some` when the
    /// turn ends with it (answered, or paused).
    async fn batch(
        &self,
        run: &mut Run<'_>,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        calls: Vec<ToolCall>,
    ) -> Option<TurnResult> {
        let offered = run.offered.clone().unwrap_or_default();
        let (calls, mut refused): (Vec<ToolCall>, Vec<ToolCall>) =
            calls.into_iter().partition(|call| {
                !self.config.offered_only || offered.iter().any(|t| t.name == call.name)
            });
        let triage = self.triage(run, tools, calls);
        let outcomes = self
            .run_tools(run, invoke, tools, &offered, &triage.free)
            .await;
        let mut ran = Ran {
            outcomes: refused.iter().map(not_offered).collect(),
            calls: std::mem::take(&mut refused),
        };
        ran.calls.extend(triage.free);
        ran.outcomes.extend(outcomes);
        self.conclude(run, tools, ran, triage.skipped, triage.hold, triage.later)
    }

    /// After calls ran: pauses for those that failed for their environment
    /// (when the loop does), records the outcomes, and ends the turn when
    /// they answer it (`return_direct`) or a group waits for a decision.
    fn conclude(
        &self,
        run: &mut Run<'_>,
        tools: &[Arc<ToolSpec>],
        ran: Ran,
        skipped: Vec<ToolCall>,
        hold: Option<Hold>,
        later: Vec<ToolCall>,
    ) -> Option<TurnResult> {
        let skip = |calls: &[ToolCall]| calls.iter().map(|_| Err(skipped_error())).collect();
        let failed_env =
            |o: &Result<String, ChainError>| matches!(o, Err(e) if e.kind == ErrorKind::Auth);
        if self.pauses_on_env_error(tools) && ran.outcomes.iter().any(failed_env) {
            let (mut failed, mut done) = (Vec::new(), (Vec::new(), Vec::new()));
            let mut reason = String::new();
            for (call, outcome) in ran.calls.into_iter().zip(ran.outcomes) {
                match outcome {
                    Err(error) if error.kind == ErrorKind::Auth => {
                        if failed.is_empty() {
                            reason = format!(
                                "tool '{}' failed for its environment: {}",
                                call.name, error.message
                            );
                        }
                        failed.push(call);
                    }
                    outcome => {
                        done.0.push(call);
                        done.1.push(outcome);
                    }
                }
            }
            run.record(tools, done.0, done.1);
            let outcomes = skip(&skipped);
            run.record(tools, skipped, outcomes);
            let later = hold.map(|h| h.calls).into_iter().flatten().chain(later);
            let hold = Hold {
                kind: InterruptKind::EnvRetry,
                reason,
                calls: failed,
            };
            return Some(run.pause(hold, later.collect()));
        }
        run.record(tools, ran.calls, ran.outcomes);
        let outcomes = skip(&skipped);
        run.record(tools, skipped, outcomes);
        if hold.is_none() && later.is_empty() {
            if self.config.stop_on_all_denied
                && let Some(stopped) = run.all_denied()
            {
                return Some(stopped);
            }
            return run.settle();
        }
        hold.map(|hold| run.pause(hold, later))
    }
}

/// The error a call to a tool not offered in its round gets
/// ([`LoopConfig::offered_only`]).
fn not_offered(call: &ToolCall) -> Result<String, ChainError> {
    Err(ChainError::new(
        ErrorKind::InvalidRequest,
        format!("tool '{}' was not offered in this round", call.name),
    )
    .at(Origin::terminal("tool-loop")))
}

/// A batch's calls, sorted by [`ToolLoop::triage`].
struct Triage {
    free: Vec<ToolCall>,
    skipped: Vec<ToolCall>,
    hold: Option<Hold>,
    later: Vec<ToolCall>,
}

/// Calls that wait for one decision, and why.
pub(super) struct Hold {
    pub(super) kind: InterruptKind,
    pub(super) reason: String,
    pub(super) calls: Vec<ToolCall>,
}

/// Calls that ran, and their outcomes in call order.
struct Ran {
    calls: Vec<ToolCall>,
    outcomes: Vec<Result<String, ChainError>>,
}

/// A call skipped because the turn paused for another call of its batch.
fn skipped_error() -> ChainError {
    ChainError::new(
        ErrorKind::InvalidRequest,
        "the call was skipped: the turn paused for another call of its batch",
    )
}

/// The conversation an invoke belongs to, from its context.
/// The spec of the registered tool `name`.
fn spec_of<'a>(tools: &'a [Arc<ToolSpec>], name: &str) -> Option<&'a Arc<ToolSpec>> {
    tools.iter().find(|tool| tool.name == name)
}

fn conversation(invoke: &Invoke) -> Option<String> {
    invoke.context().get(CONVERSATION_ID).map(|id| match id {
        serde_json::Value::String(id) => id,
        other => other.to_string(),
    })
}

/// Where a paused turn stopped: its messages and calls so far, its model
/// rounds, the calls waiting for a decision, and the calls of the same
/// batch that wait for one after them.
#[derive(Debug, PartialEq)]
pub struct Paused {
    messages: Vec<Message>,
    calls: Vec<ToolCallRecord>,
    rounds: u32,
    pending: Vec<ToolCall>,
    later: Vec<ToolCall>,
    /// The `on_tool_call` policy's verdicts so far.
    verdicts: Vec<(ToolCall, Option<String>)>,
    /// The paused batch's outputs so far, while it may answer the turn.
    direct: Option<Vec<String>>,
    /// The tools the model was last offered, for the calls that run on
    /// resume.
    offered: Option<Arc<Vec<ToolSpec>>>,
    /// The paused batch's refusals so far, while every call of it was
    /// refused.
    denied: Option<Vec<String>>,
    last: ChatResponse,
}

#[async_trait]
impl Terminal<Turn> for ToolLoop {
    async fn call(&self, request: TurnRequest, invoke: &Arc<Invoke>, _: &Context) -> TurnResult {
        let tools = invoke.onion().tools.as_slice();
        let offered: Arc<Vec<ToolSpec>> = Arc::new(tools.iter().map(|t| (**t).clone()).collect());
        let history = self.history.as_ref();
        // Only the first run of a resumed invoke continues the paused turn;
        // a turn filter's re-entry after it runs a fresh loop.
        // An interrupt from another terminal holds something else: a turn
        // of ours starts afresh then.
        let resumed = if request.resume {
            invoke.take_resumed().and_then(|(paused, decision)| {
                let paused = paused.state.downcast::<Paused>().ok()?;
                Some((paused, decision))
            })
        } else {
            None
        };
        let mut run = match &resumed {
            Some((paused, _)) => Run::resume(history, invoke, paused),
            None => Run::start(history, invoke, &request),
        };
        if let Some((paused, decision)) = resumed
            && let Some(end) = self.go_on(&mut run, invoke, tools, &paused, decision).await
        {
            return end;
        }
        for round in run.rounds + 1..=self.config.max_iterations {
            if let Some(max) = self.config.max_tool_calls
                && run.calls.len() >= max as usize
            {
                let made = run.calls.len();
                return run.stop(format!(
                    "the turn made {made} tool calls; the limit is {max}"
                ));
            }
            match self.round(&mut run, invoke, tools, &offered, round).await {
                Some(Ended::Turn(end)) => return end,
                Some(Ended::Answered(response)) => return run.done(response),
                None => {}
            }
        }
        let max = self.config.max_iterations;
        run.stop(format!(
            "the turn reached {max} model rounds without a final answer"
        ))
    }
}
