//! The tool loop as the turn chain's terminal (PEER-CASES O and H): rounds,
//! concurrent batches, limits, return_direct, tool errors, history and
//! validation re-entry, FCtx folding at the batch barrier, streaming turns.
//! Human approval of sensitive tools is in `approval`, system prompts in
//! `system_prompt`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::{FinishReason, Message, Role, ToolSpec, TurnDone, TurnRequest, TurnResult};
use shallot::{
    ChainError, Context, ErrorKind, Kernel, KernelBuilder, LoopConfig, MemoryHistory, ToolLoop,
};
use shallot_tests::{Collector, Reply, ScriptedModel, load, spec};

pub(crate) fn go(text: &str) -> TurnRequest {
    TurnRequest::new(vec![Message::user(text)])
}

pub(crate) fn texts(messages: &[Message]) -> Vec<String> {
    messages.iter().map(Message::text).collect()
}

/// The texts of the tool results among `messages`.
pub(crate) fn tool_texts(messages: &[Message]) -> Vec<String> {
    messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(Message::text)
        .collect()
}

pub(crate) fn done(result: TurnResult) -> TurnDone {
    match result {
        TurnResult::Done(done) => done,
        other => panic!("expected a done turn, got {other:?}"),
    }
}

pub(crate) fn add_tool(builder: KernelBuilder) -> KernelBuilder {
    let spec = ToolSpec::new("add", "adds a and b", json!({"type": "object"}));
    builder.tool(spec, |args: Value, _| async move {
        Ok(json!(
            args["a"].as_i64().unwrap_or(0) + args["b"].as_i64().unwrap_or(0)
        ))
    })
}

// PEER-CASES O18
#[tokio::test]
async fn a_tool_round_then_a_final_answer() {
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 2})),
        Reply::Text("It is 3.".into()),
    ]);
    let kernel = add_tool(Kernel::builder())
        .model(model.clone())
        .build()
        .unwrap();
    let done = done(kernel.turn(go("1+2?"), Context::new()).await);
    assert_eq!(done.response.text(), "It is 3.");
    assert_eq!(done.iterations, 2, "model rounds, not tool calls");
    assert_eq!(done.tool_calls.len(), 1);
    assert_eq!(done.tool_calls[0].output.as_deref(), Some("3"));
    let roles: Vec<Role> = done.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::Tool, Role::Assistant]
    );
    assert_eq!(
        model.requests()[1].messages[2].text(),
        "3",
        "the model saw the tool result"
    );
    assert!(
        model.requests()[0].tools.iter().any(|t| t.name == "add"),
        "the tools are offered"
    );
}

/// Tools `a`, `b`, `c` that record how many of them ran at once.
fn gauged(builder: KernelBuilder, serial_c: bool) -> (KernelBuilder, Arc<AtomicUsize>) {
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut builder = builder;
    for name in ["a", "b", "c"] {
        let mut tool = ToolSpec::new(name, "", json!({"type": "object"}));
        tool.serial = serial_c && name == "c";
        let (running, most) = (running.clone(), most.clone());
        builder = builder.tool(tool, move |_, _| {
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(json!(name))
            }
        });
    }
    (builder, most)
}

fn three_calls() -> ScriptedModel {
    let calls = ["a", "b", "c"]
        .iter()
        .map(|n| (n.to_string(), json!({})))
        .collect();
    ScriptedModel::replies(vec![Reply::Calls(calls), Reply::Text("done".into())])
}

// PEER-CASES O19
#[tokio::test]
async fn a_batch_runs_concurrently_and_results_keep_call_order() {
    let (builder, most) = gauged(Kernel::builder(), false);
    let kernel = builder.model(three_calls()).build().unwrap();
    let done = done(kernel.turn(go("go"), Context::new()).await);
    assert_eq!(most.load(Ordering::SeqCst), 3);
    let names: Vec<&str> = done
        .tool_calls
        .iter()
        .map(|r| r.call.name.as_str())
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(
        tool_texts(&done.messages),
        ["a", "b", "c"],
        "a JSON string result reaches the model as its text"
    );
}

// PEER-CASES O28
#[tokio::test]
async fn a_serial_tool_makes_its_whole_batch_sequential() {
    let (builder, most) = gauged(Kernel::builder(), true);
    let kernel = builder.model(three_calls()).build().unwrap();
    done(kernel.turn(go("go"), Context::new()).await);
    assert_eq!(most.load(Ordering::SeqCst), 1);
}

// PEER-CASES O20
#[tokio::test]
async fn parallel_tools_can_be_turned_off() {
    let config = LoopConfig {
        parallel_tools: false,
        ..LoopConfig::default()
    };
    let (builder, most) = gauged(Kernel::builder(), false);
    let kernel = builder
        .model(three_calls())
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
        .build()
        .unwrap();
    done(kernel.turn(go("go"), Context::new()).await);
    assert_eq!(most.load(Ordering::SeqCst), 1);
}

fn endless_tools(config: LoopConfig) -> (Kernel, ScriptedModel) {
    let model = ScriptedModel::new(|_, _| Reply::call("add", json!({"a": 1, "b": 1})));
    let kernel = add_tool(Kernel::builder())
        .model(model.clone())
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()));
    (kernel.build().unwrap(), model)
}

fn limit(result: TurnResult) -> (ChainError, Arc<TurnDone>) {
    match result {
        TurnResult::Error(error) if error.kind == ErrorKind::LimitExceeded => {
            let ran = error.ran.clone().expect("a limit error keeps what ran");
            (error, ran)
        }
        other => panic!("expected a limit error, got {other:?}"),
    }
}

// PEER-CASES O11
#[test]
fn max_tool_calls_is_unlimited_by_default_and_a_set_limit_is_kept() {
    assert_eq!(LoopConfig::default().max_tool_calls, None);
    let config = LoopConfig {
        max_tool_calls: Some(3),
        ..LoopConfig::default()
    };
    assert_eq!(config.max_tool_calls, Some(3));
}

// PEER-CASES O12
#[tokio::test]
async fn max_tool_calls_stops_the_turn_and_keeps_the_calls() {
    let (kernel, _) = endless_tools(LoopConfig {
        max_tool_calls: Some(3),
        max_iterations: 100,
        ..LoopConfig::default()
    });
    let (error, ran) = limit(kernel.turn(go("loop"), Context::new()).await);
    assert!(error.message.contains("limit is 3"), "{error}");
    assert!(ran.tool_calls.len() >= 3);
}

// PEER-CASES O17
#[tokio::test]
async fn a_limit_of_one_tool_call_makes_exactly_one() {
    let (kernel, _) = endless_tools(LoopConfig {
        max_tool_calls: Some(1),
        ..LoopConfig::default()
    });
    let (_, ran) = limit(kernel.turn(go("loop"), Context::new()).await);
    assert_eq!(ran.tool_calls.len(), 1);
}

// PEER-CASES O14
#[tokio::test]
async fn max_iterations_stops_an_endless_tool_loop() {
    let (kernel, model) = endless_tools(LoopConfig {
        max_iterations: 3,
        ..LoopConfig::default()
    });
    let (error, ran) = limit(kernel.turn(go("loop"), Context::new()).await);
    assert!(error.message.contains("3 model rounds"), "{error}");
    assert_eq!(model.calls(), 3);
    assert_eq!(ran.iterations, 3);
}

// PEER-CASES O15
#[tokio::test]
async fn under_the_limits_the_turn_finishes() {
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 1})),
        Reply::Text("done".into()),
    ]);
    let config = LoopConfig {
        max_tool_calls: Some(3),
        ..LoopConfig::default()
    };
    let kernel = add_tool(Kernel::builder())
        .model(model)
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()));
    assert_eq!(
        done(kernel.build().unwrap().turn(go("x"), Context::new()).await)
            .response
            .text(),
        "done"
    );
}

/// Tools `direct` (return_direct, answers `TOOL-OUT`/`arg`), `plain`, and
/// `broken` (return_direct, fails).
fn direct_kernel(replies: Vec<Reply>) -> (Kernel, ScriptedModel) {
    let model = ScriptedModel::replies(replies);
    let kernel = direct_tools(Kernel::builder().model(model.clone()))
        .build()
        .unwrap();
    (kernel, model)
}

/// [`direct_kernel`]'s tools.
fn direct_tools(builder: KernelBuilder) -> KernelBuilder {
    builder
            .tool(
                ToolSpec::new("direct", "", json!({})).return_direct(),
                |args: Value, _| async move {
                    Ok(args.get("out").cloned().unwrap_or(json!("TOOL-OUT")))
                },
            )
            .tool(ToolSpec::new("plain", "", json!({})), |_, _| async {
                Ok(json!("plain-out"))
            })
            .tool(
                ToolSpec::new("broken", "", json!({})).return_direct(),
                |_, _| async { Err(ChainError::new(ErrorKind::Transient, "broken tool")) },
            )
}

/// A turn filter that keeps the metadata of the answers it sees pass.
#[derive(Default)]
struct Observer {
    seen: Arc<std::sync::Mutex<Vec<shallot::types::JsonMap>>>,
}

#[async_trait::async_trait]
impl shallot::Filter for Observer {
    fn name(&self) -> &str {
        "observer"
    }

    async fn around_turn(
        &self,
        request: TurnRequest,
        next: shallot::Next<shallot::Turn>,
    ) -> TurnResult {
        let result = next.call(request).await;
        if let TurnResult::Done(done) = &result {
            self.seen
                .lock()
                .unwrap()
                .push(done.response.metadata.clone());
        }
        result
    }
}

// PEER-CASES O2, H17
/// O2/H17: a turn filter sees that a return_direct tool answered the turn.
#[tokio::test]
async fn a_turn_filter_sees_a_return_direct_answer_as_such() {
    let observer = Observer::default();
    let seen = observer.seen.clone();
    let model = ScriptedModel::replies(vec![Reply::call("direct", json!({}))]);
    let kernel = direct_tools(Kernel::builder().model(model).filter(observer))
        .build()
        .unwrap();
    done(kernel.turn(go("x"), Context::new()).await);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].get("return_direct"), Some(&json!(true)));
}

// PEER-CASES O8, O9, O10
/// O8–O10: whether a tool is return_direct is on its spec; it defaults to
/// false, and a tool the kernel does not have has none.
#[test]
fn return_direct_is_on_the_tools_spec_and_off_by_default() {
    let kernel = direct_tools(Kernel::builder()).build().unwrap();
    let direct = |name: &str| {
        kernel
            .tools()
            .into_iter()
            .find(|t| t.name == name)
            .map(|t| t.return_direct)
    };
    assert_eq!(direct("direct"), Some(true));
    assert_eq!(direct("plain"), Some(false));
    assert_eq!(direct("nonexistent"), None);
    assert!(!ToolSpec::new("t", "", json!({})).return_direct);
}

// PEER-CASES O22
/// O22: a streamed turn's tokens reach the sink in order, and the answer
/// is their text.
#[tokio::test]
async fn a_streamed_turn_delivers_its_tokens_in_order() {
    let model = ScriptedModel::replies(vec![Reply::tokens(&["Hel", "lo", "!"])]);
    let kernel = Kernel::builder().model(model).build().unwrap();
    let sink = Collector::default();
    let done = done(
        kernel
            .turn_stream(go("x"), Context::new(), sink.clone())
            .await,
    );
    assert_eq!(done.response.text(), "Hello!");
    assert_eq!(sink.tokens(), ["Hel", "lo", "!"]);
}

// PEER-CASES O1
#[tokio::test]
async fn a_return_direct_tool_is_the_answer_without_another_model_round() {
    let (kernel, model) = direct_kernel(vec![
        Reply::call("direct", json!({})),
        Reply::Text("llm-answer".into()),
    ]);
    let done = done(kernel.turn(go("x"), Context::new()).await);
    assert_eq!(done.response.text(), "TOOL-OUT");
    assert_eq!(done.response.finish_reason, FinishReason::Complete);
    assert_eq!(
        done.response.metadata.get("return_direct"),
        Some(&json!(true))
    );
    assert_eq!(model.calls(), 1);
}

// PEER-CASES O4
#[tokio::test]
async fn several_return_direct_outputs_join_with_newlines() {
    let calls = vec![
        ("direct".into(), json!({"out": "AA"})),
        ("direct".into(), json!({"out": "BB"})),
    ];
    let (kernel, model) =
        direct_kernel(vec![Reply::Calls(calls), Reply::Text("llm-answer".into())]);
    assert_eq!(
        done(kernel.turn(go("x"), Context::new()).await)
            .response
            .text(),
        "AA\nBB"
    );
    assert_eq!(model.calls(), 1);
}

// PEER-CASES O3, O5, O6, O7
#[tokio::test]
async fn the_model_answers_unless_every_call_returns_direct_and_succeeds() {
    for calls in [
        vec![("plain".to_owned(), json!({}))],
        vec![("direct".into(), json!({})), ("plain".into(), json!({}))],
        vec![("broken".into(), json!({}))],
        vec![("direct".into(), json!({})), ("broken".into(), json!({}))],
    ] {
        let (kernel, model) = direct_kernel(vec![
            Reply::Calls(calls.clone()),
            Reply::Text("llm-answer".into()),
        ]);
        assert_eq!(
            done(kernel.turn(go("x"), Context::new()).await)
                .response
                .text(),
            "llm-answer",
            "{calls:?}"
        );
        assert_eq!(model.calls(), 2);
    }
}

// PEER-CASES O25
#[tokio::test]
async fn a_failing_or_unknown_tool_goes_back_to_the_model_as_a_json_error() {
    let calls = vec![("broken".into(), json!({})), ("ghost".into(), json!({}))];
    let (kernel, model) = direct_kernel(vec![Reply::Calls(calls), Reply::Text("handled".into())]);
    let done = done(kernel.turn(go("x"), Context::new()).await);
    assert_eq!(done.response.text(), "handled");
    let errors: Vec<Value> = model.requests()[1]
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| serde_json::from_str(&m.text()).unwrap())
        .collect();
    assert_eq!(
        errors[0],
        json!({"error": {"type": "tool_error", "kind": "transient", "message": "broken tool"}})
    );
    assert_eq!(errors[1]["error"]["type"], "tool_error");
    assert_eq!(errors[1]["error"]["kind"], "not-found");
    assert!(
        done.tool_calls
            .iter()
            .all(|r| r.error.is_some() && r.output.is_none())
    );
}

#[tokio::test]
async fn history_is_loaded_for_the_same_conversation_and_can_be_skipped() {
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer-{n}")));
    let kernel = Kernel::builder().model(model.clone()).build().unwrap();
    let conversation = || Context::new().with("conversation_id", "c1");
    done(kernel.turn(go("first"), conversation()).await);
    let second = done(kernel.turn(go("second"), conversation()).await);
    assert_eq!(
        texts(&second.messages),
        ["first", "answer-1", "second", "answer-2"]
    );
    let fresh = TurnRequest {
        load_history: false,
        ..go("third")
    };
    done(kernel.turn(fresh, conversation()).await);
    assert_eq!(texts(&model.requests()[2].messages), ["third"]);
    done(
        kernel
            .turn(go("other"), Context::new().with("conversation_id", "c2"))
            .await,
    );
    assert_eq!(
        texts(&model.requests()[3].messages),
        ["other"],
        "conversations are separate"
    );
}

pub(crate) fn reviser(retries: u32) -> (std::path::PathBuf, shallot::FilterSpec) {
    let revise = json!({ "accept": "good", "feedback": "be better", "retries": retries });
    spec(
        "probe",
        "validation",
        json!({ "revise": revise, "hooks": ["turn"] }),
    )
}

// PEER-CASES H7
#[tokio::test]
async fn validation_reenters_with_the_run_messages_and_feedback() {
    let plugins = load(vec![reviser(2)]).await;
    let model = ScriptedModel::replies(vec![Reply::Text("bad".into()), Reply::Text("good".into())]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let done = done(kernel.turn(go("MY-QUESTION"), Context::new()).await);
    assert_eq!(done.response.text(), "good");
    assert_eq!(model.calls(), 2);
    assert_eq!(
        texts(&model.requests()[1].messages),
        ["MY-QUESTION", "bad", "be better"],
        "without history the question survives"
    );
}

// PEER-CASES H8
#[tokio::test]
async fn exhausted_retries_return_the_last_answer() {
    let plugins = load(vec![reviser(1)]).await;
    let model = ScriptedModel::answer("bad");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    assert_eq!(
        done(kernel.turn(go("q"), Context::new()).await)
            .response
            .text(),
        "bad"
    );
    assert_eq!(model.calls(), 2);
}

// PEER-CASES H16
#[tokio::test]
async fn reentry_with_history_stores_and_sends_nothing_twice() {
    let plugins = load(vec![reviser(2)]).await;
    let model = ScriptedModel::replies(vec![
        Reply::Text("bad".into()),
        Reply::Text("good".into()),
        Reply::Text("next".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let conversation = || Context::new().with("conversation_id", "h16");
    done(kernel.turn(go("MY-QUESTION"), conversation()).await);
    let second_call = &model.requests()[1].messages;
    assert_eq!(
        second_call
            .iter()
            .filter(|m| m.text() == "MY-QUESTION")
            .count(),
        1
    );
    done(kernel.turn(go("again"), conversation()).await);
    assert_eq!(
        texts(&model.requests()[2].messages),
        ["MY-QUESTION", "bad", "be better", "good", "again"]
    );
}

#[tokio::test]
async fn concurrent_tool_calls_see_the_batch_start_state_and_their_writes_fold_in_call_order() {
    let counter = spec(
        "probe",
        "counter",
        json!({ "tag": "k", "count": true, "hooks": ["tool"] }),
    );
    let plugins = load(vec![counter]).await;
    for (serial, expected) in [(false, 1), (true, 3)] {
        let (builder, _) = gauged(Kernel::builder().plugins(&plugins), serial);
        let kernel = builder.model(three_calls()).build().unwrap();
        let context = Context::new();
        done(kernel.turn(go("go"), context.clone()).await);
        assert_eq!(
            context.get("fctx:k"),
            Some(json!({ "n": expected })),
            "serial: {serial}"
        );
    }
}

// PEER-CASES O23
#[tokio::test]
async fn a_streamed_turn_streams_every_round_and_keeps_the_original_answer() {
    let plugins = load(vec![spec(
        "token_redact",
        "redact",
        json!({ "pattern": "sk-[a-z0-9]+", "replacement": "[KEY]" }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 2})),
        Reply::tokens(&["key ", "sk-abc1", "23"]),
    ]);
    let kernel = add_tool(Kernel::builder().plugins(&plugins))
        .model(model)
        .build()
        .unwrap();
    let sink = Collector::default();
    let done = done(
        kernel
            .turn_stream(go("x"), Context::new(), sink.clone())
            .await,
    );
    assert_eq!(
        sink.text(),
        "key [KEY]",
        "the tool round streams nothing; the answer round is redacted"
    );
    assert_eq!(done.response.text(), "key sk-abc123");
}

#[tokio::test]
async fn the_model_gets_the_tool_schema_errors_back() {
    let model = ScriptedModel::replies(vec![
        Reply::call("calculator", json!({"expr": "1+1"})),
        Reply::Text("sorry".into()),
    ]);
    let kernel = Kernel::builder()
        .builtin_tools()
        .model(model.clone())
        .build()
        .unwrap();
    let done = done(kernel.turn(go("1+1"), Context::new()).await);
    let error = done.tool_calls[0].error.as_ref().expect("the call failed");
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(error.message.contains("do not match its schema"), "{error}");
    let sent = model.requests()[1].messages[2].text();
    assert!(
        sent.contains("expression"),
        "the model is told what is missing: {sent}"
    );
}

/// A kernel with `slow` (300 ms, the spec's own timeout if any) over a
/// loop with `config`; what the turn's one call of it gave.
/// A turn that calls the tool `slow`, which takes `takes`, under
/// `config` and the tool's `own` timeout: its output or error.
async fn slow_call(
    config: LoopConfig,
    own: Option<Duration>,
    takes: Duration,
) -> Result<String, ChainError> {
    let model = ScriptedModel::replies(vec![
        Reply::call("slow", json!({})),
        Reply::Text("done".into()),
    ]);
    let mut spec = ToolSpec::new("slow", "takes its time", json!({}));
    if let Some(own) = own {
        spec = spec.timeout(own);
    }
    let kernel = Kernel::builder()
        .model(model)
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
        .tool(spec, move |_, _| async move {
            tokio::time::sleep(takes).await;
            Ok(json!("slow-done"))
        })
        .build()
        .unwrap();
    let done = done(kernel.turn(go("x"), Context::new()).await);
    let record = done.tool_calls[0].clone();
    match record.error {
        Some(error) => Err(error),
        None => Ok(record.output.unwrap()),
    }
}

// PEER-CASES N40, N41, N42, N43
/// N40–N43: the loop's default tool timeout bounds a tool that sets none;
/// a tool's own (even `Duration::MAX`, never) wins; with none anywhere a
/// slow tool finishes; a batch deadline cuts a batch that hangs. (What a
/// deadline cuts never finishes: a stalled machine could wake both the
/// deadline and a tool that ends soon after it, and the tool would win.)
#[tokio::test]
async fn the_loops_tool_and_batch_timeouts_bound_slow_calls() {
    let hangs = Duration::from_secs(3600);
    let slow = Duration::from_millis(300);
    let bounded = LoopConfig {
        tool_timeout: Some(Duration::from_millis(100)),
        ..LoopConfig::default()
    };
    let error = slow_call(bounded, None, hangs).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "N40: {error}");
    assert!(error.message.contains("100 ms"), "{error}");
    let never = slow_call(bounded, Some(Duration::MAX), slow).await;
    assert_eq!(never.unwrap(), r#""slow-done""#, "N41");
    let unbounded = slow_call(LoopConfig::default(), None, slow).await;
    assert_eq!(unbounded.unwrap(), r#""slow-done""#, "N42");
    let cut = LoopConfig {
        batch_timeout: Some(Duration::from_millis(100)),
        ..LoopConfig::default()
    };
    let error = slow_call(cut, None, hangs).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "N43: {error}");
    assert!(error.message.contains("batch"), "{error}");
}
