//! Human in the loop: a sensitive tool pauses the turn, and
//! `Kernel::resume` approves or denies the pending calls and continues it,
//! through the turn filters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use shallot::ErrorKind;
use shallot::types::Decision;
use shallot::types::{InterruptKind, Message, Role, ToolCall, ToolSpec, TurnInterrupt, TurnResult};
use shallot::{Context, Kernel, LoopConfig, MemoryHistory, OnEnvError, ToolLoop};
use shallot_tests::{Reply, ScriptedModel, load, spec};

use crate::agent::{done, go, reviser, tool_texts};

/// A kernel builder that pauses before the sensitive `delete` tool, with
/// `delete` and `list`; how often `delete` ran.
fn approval_builder(
    plugins: &shallot::FilterSet,
    model: ScriptedModel,
) -> (shallot::KernelBuilder, Arc<AtomicUsize>) {
    let deleted = Arc::new(AtomicUsize::new(0));
    let counter = deleted.clone();
    let config = LoopConfig {
        pause_sensitive: true,
        ..LoopConfig::default()
    };
    let builder = Kernel::builder()
        .plugins(plugins)
        .model(model)
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
        .tool(
            ToolSpec::new("delete", "deletes files", json!({})).sensitive(),
            move |_, _| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok(json!("deleted"))
                }
            },
        )
        .tool(
            ToolSpec::new("list", "lists files", json!({})),
            |_, _| async { Ok(json!(["a", "b"])) },
        );
    (builder, deleted)
}

/// [`approval_builder`]'s kernel.
fn approval_kernel(
    plugins: &shallot::FilterSet,
    model: ScriptedModel,
) -> (Kernel, Arc<AtomicUsize>) {
    let (builder, deleted) = approval_builder(plugins, model);
    (builder.build().unwrap(), deleted)
}

fn delete_and_list() -> Vec<Reply> {
    let calls = vec![
        ("delete".into(), json!({"path": "/tmp/x"})),
        ("list".into(), json!({})),
    ];
    vec![
        Reply::Calls(calls),
        Reply::Text("Done! Files deleted.".into()),
    ]
}

#[tokio::test]
async fn a_sensitive_tool_pauses_the_turn_and_an_approval_resumes_it() {
    let plugins = load(vec![spec(
        "probe",
        "probe",
        json!({ "record_resume": true, "hooks": ["turn"] }),
    )])
    .await;
    let model = ScriptedModel::replies(delete_and_list());
    let (kernel, deleted) = approval_kernel(&plugins, model.clone());
    let context = Context::new().with("conversation_id", "hitl");
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), context.clone()).await
    else {
        panic!("expected an interrupt")
    };
    assert_eq!(
        interrupt.pending.as_ref().map(|c| c.name.as_str()),
        Some("delete")
    );
    assert_eq!(deleted.load(Ordering::SeqCst), 0, "nothing sensitive ran");
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, context.clone())
            .await,
    );
    assert_eq!(done.response.text(), "Done! Files deleted.");
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    let names: Vec<&str> = done
        .tool_calls
        .iter()
        .map(|r| r.call.name.as_str())
        .collect();
    assert_eq!(
        names,
        ["list", "delete"],
        "the safe call ran before the pause"
    );
    assert_eq!(model.calls(), 2);
    assert_eq!(
        context.get("resume"),
        Some(json!([false, true])),
        "turn filters see the resume flag"
    );
}

// PEER-CASES O47
/// O47: a pause continues once. Resuming a clone of its interrupt again
/// (a retried request, a double click) is an error, not a second run of
/// the sensitive call; a resume of an interrupt that holds no pause too.
#[tokio::test]
async fn a_pause_is_resumed_once_and_a_second_resume_is_an_error() {
    let mut replies = delete_and_list();
    replies.push(Reply::Text("again".into()));
    let model = ScriptedModel::replies(replies);
    let (kernel, deleted) = approval_kernel(&shallot::FilterSet::default(), model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("expected an interrupt")
    };
    let again = interrupt.clone();
    done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    let TurnResult::Error(error) = kernel
        .resume(again, Decision::Approve, Context::new())
        .await
    else {
        panic!("a second resume fails")
    };
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
    assert!(error.message.contains("already resumed"), "{error}");
    assert_eq!(
        deleted.load(Ordering::SeqCst),
        1,
        "the sensitive call ran once"
    );
    assert_eq!(model.calls(), 2);

    let stray = TurnInterrupt::new("made by hand", None);
    let TurnResult::Error(error) = kernel
        .resume(stray, Decision::Approve, Context::new())
        .await
    else {
        panic!("nothing to resume")
    };
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
}

// PEER-CASES O41
/// O41: a pause keeps the shared context: a tool that wrote beside the
/// paused call, and a resume given a fresh context, still lets the next
/// round's reader see it.
#[tokio::test]
async fn a_resumed_turn_sees_what_tools_wrote_before_the_pause() {
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("delete".into(), json!({})),
            ("write".into(), json!({})),
        ]),
        Reply::Calls(vec![("read".into(), json!({}))]),
        Reply::Text("done".into()),
    ]);
    let config = LoopConfig {
        pause_sensitive: true,
        ..LoopConfig::default()
    };
    let kernel = Kernel::builder()
        .model(model.clone())
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()))
        .tool(
            ToolSpec::new("delete", "", json!({})).sensitive(),
            |_, _| async { Ok(json!("deleted")) },
        )
        .tool(
            ToolSpec::new("write", "", json!({})),
            |_, context: Context| async move {
                context.set("k", "kept");
                Ok(json!("written"))
            },
        )
        .tool(
            ToolSpec::new("read", "", json!({})),
            |_, context: Context| async move {
                Ok(json!(format!(
                    "SAW:{}",
                    context.get("k").unwrap_or_default()
                )))
            },
        )
        .build()
        .unwrap();
    let TurnResult::Interrupt(paused) = kernel.turn(go("go"), Context::new()).await else {
        panic!("the turn pauses for delete")
    };
    done(
        kernel
            .resume(paused, Decision::Approve, Context::new())
            .await,
    );
    let read = tool_texts(&model.requests()[2].messages);
    assert_eq!(
        read.last().map(String::as_str),
        Some("SAW:\"kept\""),
        "{read:?}"
    );
}

#[tokio::test]
async fn a_denial_reaches_the_model_as_the_tool_result() {
    let model = ScriptedModel::replies(delete_and_list());
    let (kernel, deleted) = approval_kernel(&shallot::FilterSet::default(), model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("expected an interrupt")
    };
    done(
        kernel
            .resume(
                interrupt,
                Decision::Deny("not today".into()),
                Context::new(),
            )
            .await,
    );
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    let results: Vec<String> = model.requests()[1]
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(Message::text)
        .collect();
    assert!(
        results
            .iter()
            .any(|r| r.contains("the call was denied: not today")),
        "{results:?}"
    );
}

// PEER-CASES H5
/// H5 as written: the interrupt tool `ask_human` pauses the turn, the
/// turn filter passes the interrupt through; resumed with a reply, the
/// continuation's answer is rejected and the filter re-enters, which runs
/// a fresh loop.
#[tokio::test]
async fn a_turn_filter_may_reenter_after_the_resumed_turn() {
    let plugins = load(vec![reviser(1)]).await;
    let model = ScriptedModel::replies(vec![
        Reply::call("ask_human", json!({ "question": "which files?" })),
        Reply::Text("answer-1".into()),
        Reply::Text("good".into()),
    ]);
    let (builder, _) = approval_builder(&plugins, model.clone());
    let ask = ToolSpec::new("ask_human", "asks the user", json!({}));
    let kernel = builder.interrupt_tool(ask).build().unwrap();
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("the filter passes the interrupt through")
    };
    assert_eq!(interrupt.kind, InterruptKind::ToolRequest);
    let done = done(
        kernel
            .resume(interrupt, Decision::Reply("hi".into()), Context::new())
            .await,
    );
    assert_eq!(
        done.response.text(),
        "good",
        "the re-entry ran a fresh loop, not the paused turn again"
    );
    assert_eq!(model.calls(), 3);
}

/// [`approval_kernel`] with the interrupt tool `ask_human` too.
fn asking_kernel(model: ScriptedModel) -> (Kernel, Arc<AtomicUsize>) {
    let (builder, deleted) = approval_builder(&shallot::FilterSet::default(), model);
    let ask = ToolSpec::new(
        "ask_human",
        "asks the user a question",
        json!({"type": "object", "properties": {"question": {"type": "string"}}}),
    );
    (builder.interrupt_tool(ask).build().unwrap(), deleted)
}

// PEER-CASES O45, O48
/// O45, O48: calling an interrupt tool pauses the turn (`tool_request`,
/// the call's arguments the question) after the batch's other calls ran,
/// and the reply it is resumed with is the tool's result.
#[tokio::test]
async fn an_interrupt_tool_pauses_the_turn_and_the_reply_is_its_result() {
    let ask = (
        "ask_human".to_owned(),
        json!({"question": "delete /tmp/x?"}),
    );
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![ask, ("list".into(), json!({}))]),
        Reply::Text("Done! Files deleted.".into()),
    ]);
    let (kernel, _) = asking_kernel(model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("an interrupt tool pauses the turn")
    };
    assert_eq!(interrupt.kind, InterruptKind::ToolRequest);
    assert_eq!(interrupt.kind.as_str(), "tool_request");
    let pending = interrupt.pending.clone().unwrap();
    assert_eq!(pending.name, "ask_human");
    assert!(pending.arguments.contains("delete /tmp/x?"), "{pending:?}");
    let done = done(
        kernel
            .resume(
                interrupt,
                Decision::Reply("yes, go ahead".into()),
                Context::new(),
            )
            .await,
    );
    assert_eq!(done.response.text(), "Done! Files deleted.");
    assert_eq!(model.calls(), 2);
    let sent = model.requests()[1].messages.clone();
    let results = tool_texts(&sent);
    assert!(results.contains(&"yes, go ahead".to_owned()), "{results:?}");
    assert!(
        results.iter().any(|r| r.contains("\"a\"")),
        "list ran: {results:?}"
    );
}

/// An interrupt tool has no code: approving its call gives the model an
/// error, never a made-up answer.
#[tokio::test]
async fn an_approved_interrupt_tool_call_is_an_error_for_the_model() {
    let model = ScriptedModel::replies(vec![
        Reply::call("ask_human", json!({"question": "?"})),
        Reply::Text("ok".into()),
    ]);
    let (kernel, _) = asking_kernel(model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("hi"), Context::new()).await else {
        panic!("an interrupt tool pauses the turn")
    };
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    let error = done.tool_calls[0].error.as_ref().expect("the call failed");
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(error.message.contains("question for a human"), "{error}");
}

/// A batch with an interrupt tool and a sensitive call pauses twice: the
/// question first, then the approval; the sensitive call never runs
/// before it is approved.
#[tokio::test]
async fn an_interrupt_tool_and_a_sensitive_call_in_one_batch_pause_one_after_the_other() {
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("delete".into(), json!({"path": "/tmp/x"})),
            ("ask_human".into(), json!({"question": "sure?"})),
        ]),
        Reply::Text("Done! Files deleted.".into()),
    ]);
    let (kernel, deleted) = asking_kernel(model.clone());
    let TurnResult::Interrupt(first) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("the question pauses the turn")
    };
    assert_eq!(first.kind, InterruptKind::ToolRequest);
    let TurnResult::Interrupt(second) = kernel
        .resume(first, Decision::Reply("yes".into()), Context::new())
        .await
    else {
        panic!("then the sensitive call waits for approval")
    };
    assert_eq!(second.kind, InterruptKind::Approval);
    assert_eq!(second.pending.as_ref().unwrap().name, "delete");
    assert_eq!(deleted.load(Ordering::SeqCst), 0);
    let done = done(
        kernel
            .resume(second, Decision::Approve, Context::new())
            .await,
    );
    assert_eq!(done.response.text(), "Done! Files deleted.");
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
    assert_eq!(model.calls(), 2, "one model round for the whole batch");
}

/// What the statements a policed kernel's `sql` tool ran, and how often
/// its policy was asked.
struct Policed {
    ran: Arc<std::sync::Mutex<Vec<String>>>,
    asked: Arc<AtomicUsize>,
}

/// A kernel whose `sql` tool the policy holds for `DELETE` and `DROP`
/// statements (and panics on `PANIC`), with the interrupt tool
/// `ask_human`.
fn policed_kernel(model: ScriptedModel) -> (Kernel, Policed) {
    let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
    let asked = Arc::new(AtomicUsize::new(0));
    let (log, counter) = (ran.clone(), asked.clone());
    let policy = move |call: &ToolCall| {
        counter.fetch_add(1, Ordering::SeqCst);
        let arguments: serde_json::Value = serde_json::from_str(&call.arguments).ok()?;
        let statement = arguments["q"].as_str()?;
        assert!(!statement.starts_with("PANIC"), "a policy that panics");
        let risky = statement.starts_with("DELETE") || statement.starts_with("DROP");
        risky.then(|| format!("'{statement}' needs a human"))
    };
    let kernel = Kernel::builder()
        .model(model)
        .turn_terminal(ToolLoop::default().on_tool_call(policy))
        .interrupt_tool(ToolSpec::new("ask_human", "asks the user", json!({})))
        .tool(
            ToolSpec::new("sql", "runs SQL", json!({})),
            move |args, _| {
                let log = log.clone();
                async move {
                    log.lock()
                        .unwrap()
                        .push(args["q"].as_str().unwrap().to_owned());
                    Ok(json!("ok"))
                }
            },
        )
        .build()
        .unwrap();
    (kernel, Policed { ran, asked })
}

// PEER-CASES O46
/// O46: an `on_tool_call` policy holds a call (`callback`, with its
/// reason); the batch's safe calls run first, the other calls it holds in
/// that batch are skipped, and an approval runs the held one.
#[tokio::test]
async fn an_on_tool_call_policy_holds_a_call_and_skips_the_others_it_holds() {
    let sql = |q: &str| ("sql".to_owned(), json!({ "q": q }));
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            sql("DELETE FROM t"),
            sql("SELECT 1"),
            sql("DROP TABLE t"),
        ]),
        Reply::Text("Done! Files deleted.".into()),
    ]);
    let (kernel, Policed { ran, .. }) = policed_kernel(model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("tidy"), Context::new()).await else {
        panic!("the policy pauses the turn")
    };
    assert_eq!(interrupt.kind, InterruptKind::Callback);
    assert_eq!(interrupt.reason, "'DELETE FROM t' needs a human");
    assert_eq!(*ran.lock().unwrap(), ["SELECT 1"], "only the safe call ran");
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    assert_eq!(done.response.text(), "Done! Files deleted.");
    assert_eq!(*ran.lock().unwrap(), ["SELECT 1", "DELETE FROM t"]);
    let skipped = done
        .tool_calls
        .iter()
        .find(|r| r.call.arguments.contains("DROP"))
        .unwrap();
    let error = skipped.error.as_ref().expect("skipped, not run");
    assert!(error.message.contains("skipped"), "{error}");
}

// PEER-CASES O26
/// The policy is asked about each call once, though a call it holds
/// behind a question waits through two pauses; and a policy that panics
/// (O26: a callback's exception is swallowed) lets its call go on.
#[tokio::test]
async fn the_policy_is_asked_once_a_call_and_its_panic_is_swallowed() {
    let sql = |q: &str| ("sql".to_owned(), json!({ "q": q }));
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![("ask_human".into(), json!({})), sql("DELETE FROM t")]),
        Reply::call("sql", json!({ "q": "PANIC" })),
        Reply::Text("done".into()),
    ]);
    let (kernel, Policed { ran, asked }) = policed_kernel(model);
    let TurnResult::Interrupt(question) = kernel.turn(go("tidy"), Context::new()).await else {
        panic!("the question pauses the turn")
    };
    let TurnResult::Interrupt(held) = kernel
        .resume(question, Decision::Reply("yes".into()), Context::new())
        .await
    else {
        panic!("then the policy's hold")
    };
    assert_eq!(held.kind, InterruptKind::Callback);
    assert_eq!(
        asked.load(Ordering::SeqCst),
        1,
        "asked once, not again on resume"
    );
    let done = done(kernel.resume(held, Decision::Approve, Context::new()).await);
    assert_eq!(done.response.text(), "done");
    assert_eq!(*ran.lock().unwrap(), ["DELETE FROM t", "PANIC"]);
}

/// A tool that fails with an `auth` error (its environment: credentials)
/// on its first `failures` calls, then works; how often it ran.
fn deploy_tool(
    builder: shallot::KernelBuilder,
    failures: usize,
    kind: ErrorKind,
) -> (shallot::KernelBuilder, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let builder = builder.tool(
        ToolSpec::new("deploy", "deploys", json!({})),
        move |_, _| {
            let run = counter.fetch_add(1, Ordering::SeqCst);
            async move {
                if run < failures {
                    Err(shallot::ChainError::new(kind, "the deploy token expired"))
                } else {
                    Ok(json!("deployed"))
                }
            }
        },
    );
    (builder, runs)
}

fn deploying(
    model: &ScriptedModel,
    config: LoopConfig,
    kind: ErrorKind,
) -> (Kernel, Arc<AtomicUsize>) {
    let builder = Kernel::builder()
        .model(model.clone())
        .turn_terminal(ToolLoop::new(config, MemoryHistory::default()));
    let (builder, runs) = deploy_tool(builder, 1, kind);
    (builder.build().unwrap(), runs)
}

// PEER-CASES O42
/// O42: with `on_env_error: Pause`, a call failing for its environment
/// pauses the turn (`env_retry`) before the model sees it, and an
/// approval runs it again.
#[tokio::test]
async fn a_tool_failing_for_its_environment_pauses_and_an_approval_retries_it() {
    let model = ScriptedModel::replies(vec![
        Reply::call("deploy", json!({})),
        Reply::Text("done".into()),
    ]);
    let config = LoopConfig {
        on_env_error: OnEnvError::Pause,
        ..LoopConfig::default()
    };
    let (kernel, runs) = deploying(&model, config, ErrorKind::Auth);
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("ship it"), Context::new()).await else {
        panic!("an environment failure pauses the turn")
    };
    assert_eq!(interrupt.kind, InterruptKind::EnvRetry);
    assert!(
        interrupt.reason.contains("the deploy token expired"),
        "{}",
        interrupt.reason
    );
    assert_eq!(model.calls(), 1, "the model has not seen the failure");
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    assert_eq!(done.response.text(), "done");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(
        done.tool_calls.iter().all(|r| r.error.is_none()),
        "{:?}",
        done.tool_calls
    );
}

// PEER-CASES O43, O44
/// O43: by default, with no human in the loop, an environment failure
/// goes to the model. O44: a semantic failure goes to the model even
/// when environment failures pause.
#[tokio::test]
async fn other_failures_and_unpaused_ones_go_to_the_model() {
    let cases = [
        (OnEnvError::Auto, ErrorKind::Auth),
        (OnEnvError::Pause, ErrorKind::InvalidRequest),
    ];
    for (on_env_error, kind) in cases {
        let model = ScriptedModel::replies(vec![
            Reply::call("deploy", json!({})),
            Reply::Text("handled".into()),
        ]);
        let config = LoopConfig {
            on_env_error,
            ..LoopConfig::default()
        };
        let (kernel, runs) = deploying(&model, config, kind);
        let done = done(kernel.turn(go("ship it"), Context::new()).await);
        assert_eq!(done.response.text(), "handled", "{on_env_error:?} {kind:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let results = tool_texts(&model.requests()[1].messages);
        assert!(
            results[0].contains("the deploy token expired"),
            "{results:?}"
        );
    }
}

/// Two questions in one batch pause one at a time, each with its own
/// question shown and its own reply given.
#[tokio::test]
async fn two_questions_in_one_batch_are_asked_and_answered_one_at_a_time() {
    let ask = |q: &str| ("ask_human".to_owned(), json!({ "question": q }));
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![ask("budget?"), ask("deadline?")]),
        Reply::Text("planned".into()),
    ]);
    let (kernel, _) = asking_kernel(model.clone());
    let mut answers = vec![];
    let mut result = kernel.turn(go("plan"), Context::new()).await;
    while let TurnResult::Interrupt(interrupt) = result {
        let question = interrupt.pending.as_ref().unwrap().arguments.clone();
        let reply = if question.contains("budget") {
            "5 EUR"
        } else {
            "Friday"
        };
        answers.push(reply);
        result = kernel
            .resume(interrupt, Decision::Reply(reply.into()), Context::new())
            .await;
    }
    assert_eq!(done(result).response.text(), "planned");
    assert_eq!(answers, ["5 EUR", "Friday"]);
    let results = tool_texts(&model.requests()[1].messages);
    assert_eq!(results, ["5 EUR", "Friday"]);
}

/// A batch of return_direct calls paused midway is judged whole when it
/// ends: all of them worked, so their outputs together are the answer.
#[tokio::test]
async fn a_return_direct_batch_paused_midway_answers_with_every_output() {
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("status".into(), json!({})),
            ("deploy".into(), json!({})),
        ]),
        Reply::Text("the model was asked".into()),
    ]);
    let (builder, _) = approval_builder(&shallot::FilterSet::default(), model.clone());
    let direct = |name: &str| ToolSpec::new(name, name, json!({})).return_direct();
    let kernel = builder
        .tool(direct("status"), |_, _| async { Ok(json!("green")) })
        .tool(direct("deploy").sensitive(), |_, _| async {
            Ok(json!("deployed"))
        })
        .build()
        .unwrap();
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("ship"), Context::new()).await else {
        panic!("deploy waits for approval")
    };
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    assert_eq!(done.response.text(), "green\ndeployed");
    assert_eq!(model.calls(), 1);
}
