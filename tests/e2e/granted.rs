//! The filters that need a host service the operator grants (tool-retry's
//! and model-retry's `timer`, approval's `approval`, trace's `trace`), final-answer's view of
//! how a stream ended, and the abuse of each granted import: without the
//! grant, past its bound, and with forged or garbage input.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use shallot::types::{ChatRequest, ToolSpec, TurnResult};
use shallot::{
    ApprovalRequest, ChainError, Context, ErrorKind, FilterSpec, Grants, Kernel, Limits, LoadError,
};
use shallot_tests::{
    Collector, Reply, ScriptedModel, ask, granted, lines, load, spec, trace_file, trace_grant,
};

use crate::agent::{done, go};
use crate::loading::refused;

/// An approval handler's answer to a question.
type Answer = Box<dyn Fn(&ApprovalRequest) -> bool + Send + Sync>;

fn sleep_grant(sleep_ms: u32) -> Grants {
    Grants {
        sleep_ms,
        ..Grants::default()
    }
}

/// A kernel with `filter` over a `flaky` tool that fails with `kind` on
/// its first `failures` runs and answers "ok" after; the runs are counted.
async fn flaky(
    filter: (PathBuf, FilterSpec),
    kind: ErrorKind,
    failures: usize,
) -> (Kernel, Arc<AtomicUsize>) {
    let plugins = load(vec![filter]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(
            ToolSpec::new("flaky", "fails, then works", json!({ "type": "object" })),
            move |_: Value, _| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    if run <= failures {
                        Err(ChainError::new(kind, format!("failure {run}")))
                    } else {
                        Ok(json!("ok"))
                    }
                }
            },
        )
        .build()
        .unwrap();
    (kernel, runs)
}

fn retry(config: Value) -> (PathBuf, FilterSpec) {
    spec("tool_retry", "tool-retry", config)
}

#[tokio::test]
async fn tool_retry_retries_a_transient_failure_and_returns_the_last_one_when_exhausted() {
    let filter = retry(json!({ "max_retries": 3, "initial_delay_ms": 0 }));
    let (kernel, runs) = flaky(filter, ErrorKind::Timeout, usize::MAX).await;
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::Timeout, "failure 4")
    );
    shallot_tests::assert_passed_on(&error, "tool-retry");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn tool_retry_recovers_when_a_retry_works_and_leaves_success_and_other_errors_alone() {
    let filter = || retry(json!({ "initial_delay_ms": 0 }));
    let (kernel, runs) = flaky(filter(), ErrorKind::Transient, 2).await;
    let output = call(&kernel, "flaky", json!({})).await;
    assert_eq!(
        (output.as_str(), runs.load(Ordering::SeqCst)),
        ("\"ok\"", 3)
    );
    let (kernel, runs) = flaky(filter(), ErrorKind::Transient, 0).await;
    kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "success: one run");
    let (kernel, runs) = flaky(filter(), ErrorKind::InvalidRequest, 1).await;
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a semantic error is not retried"
    );
    let all = retry(json!({ "initial_delay_ms": 0, "on": ["invalid-request"] }));
    let (kernel, runs) = flaky(all, ErrorKind::InvalidRequest, 1).await;
    kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2, "retried when told to");
}

#[tokio::test]
async fn tool_retry_waits_through_the_granted_timer_and_not_on_its_own_wall_clock() {
    // 1.2 s asleep, past the default own wall bound of 1 s: waiting is not
    // the filter's own time, as time in `next` is not.
    let config = json!({ "initial_delay_ms": 1200, "max_delay_ms": 1200, "jitter": 0 });
    let (kernel, runs) = flaky(
        granted(retry(config), sleep_grant(2000)),
        ErrorKind::Transient,
        1,
    )
    .await;
    let output = call(&kernel, "flaky", json!({})).await;
    assert_eq!(
        (output.as_str(), runs.load(Ordering::SeqCst)),
        ("\"ok\"", 2)
    );
}

#[tokio::test]
async fn tool_retry_stops_retrying_when_its_grant_cannot_cover_the_wait() {
    let config = json!({ "initial_delay_ms": 50, "jitter": 0, "max_retries": 5 });
    let (kernel, runs) = flaky(retry(config.clone()), ErrorKind::Transient, usize::MAX).await;
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.message, "failure 1", "no timer granted: no retry");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // 50 ms fits a grant of 120; the next 100 would not.
    let (kernel, runs) = flaky(
        granted(retry(config), sleep_grant(120)),
        ErrorKind::Transient,
        usize::MAX,
    )
    .await;
    let error = kernel
        .tool("flaky", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.message, "failure 2");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn tool_retry_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "jitter": 2 }), "jitter"),
        (json!({ "multiplier": 0.5 }), "multiplier"),
        (
            json!({ "initial_delay_ms": 10, "max_delay_ms": 5 }),
            "max_delay_ms",
        ),
        (json!({ "backoff": "fibonacci" }), "unknown variant"),
        (json!({ "retries": 3 }), "unknown field"),
    ] {
        let error = refused("tool_retry", "tool-retry", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// `model-retry` over a model that fails with each of `failures` in turn
/// and then answers "ok": what the chat returned, and the model's calls.
async fn model_retry(
    config: Value,
    grants: Grants,
    failures: &[ErrorKind],
) -> (Result<shallot::types::ChatResponse, ChainError>, usize) {
    let filter = granted(spec("model_retry", "model-retry", config), grants);
    let plugins = load(vec![filter]).await;
    let mut replies: Vec<Reply> = failures
        .iter()
        .enumerate()
        .map(|(n, kind)| Reply::Fail(ChainError::new(*kind, format!("failure {}", n + 1))))
        .collect();
    replies.push(Reply::Text("ok".into()));
    let model = ScriptedModel::replies(replies);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let answer = kernel.chat(ask("hi"), Context::new()).await;
    (answer, model.calls())
}

/// The seed's `model_retry` cases: 429, 429, ok is three calls; a 401 is
/// one; exhausted after `max_retries` 2 is three calls and the last
/// failure as it was; the backoff waits through the granted timer, and
/// without a grant there is no retry.
#[tokio::test]
async fn model_retry_calls_the_model_again_for_passing_failures_only() {
    let at_once = || json!({ "initial_delay_ms": 0 });
    let none = Grants::default();
    let transient = ErrorKind::Transient;
    let (answer, calls) = model_retry(at_once(), none.clone(), &[transient, transient]).await;
    assert_eq!((answer.unwrap().text(), calls), ("ok".to_owned(), 3));

    let (answer, calls) = model_retry(at_once(), none.clone(), &[ErrorKind::Auth]).await;
    assert_eq!((answer.unwrap_err().kind, calls), (ErrorKind::Auth, 1));

    let config = json!({ "initial_delay_ms": 0, "max_retries": 2 });
    let (answer, calls) = model_retry(config, none.clone(), &[ErrorKind::Timeout; 3]).await;
    let error = answer.unwrap_err();
    assert_eq!((error.message.as_str(), calls), ("failure 3", 3));
    shallot_tests::assert_passed_on(&error, "model-retry");

    let waits = json!({ "initial_delay_ms": 20, "jitter": 0 });
    let (answer, calls) = model_retry(waits.clone(), sleep_grant(100), &[transient]).await;
    assert_eq!((answer.unwrap().text(), calls), ("ok".to_owned(), 2));
    let (answer, calls) = model_retry(waits, none, &[transient]).await;
    assert_eq!(
        (answer.unwrap_err().message.as_str(), calls),
        ("failure 1", 1)
    );

    let error = refused("model_retry", "model-retry", json!({ "retries": 3 })).await;
    assert!(error.to_string().contains("unknown field"), "{error}");
}

/// A kernel with `approval` (configured with `config`, granted the import
/// when `grant`) over a sensitive `delete` tool and a plain `list` tool,
/// each counting its runs, and the approver `approver` if any.
async fn approving(
    config: Value,
    grant: bool,
    approver: Option<impl shallot::Approver>,
) -> (Kernel, Arc<AtomicUsize>) {
    let filter = granted(
        spec("approval", "approval", config),
        Grants {
            approval: grant,
            ..Grants::default()
        },
    );
    let plugins = load(vec![filter]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (deleted, listed) = (runs.clone(), runs.clone());
    let tool = |name: &str| ToolSpec::new(name, name, json!({ "type": "object" }));
    let mut builder = Kernel::builder()
        .plugins(&plugins)
        .tool(tool("delete").sensitive(), move |_: Value, _| {
            deleted.fetch_add(1, Ordering::SeqCst);
            async { Ok(json!("done")) }
        })
        .tool(tool("list"), move |_: Value, _| {
            listed.fetch_add(1, Ordering::SeqCst);
            async { Ok(json!("ran")) }
        });
    if let Some(approver) = approver {
        builder = builder.approver(approver);
    }
    (builder.build().unwrap(), runs)
}

/// Calls `tool` through `kernel`'s tool chain; its output.
async fn call(kernel: &Kernel, tool: &str, arguments: Value) -> String {
    let response = kernel.tool(tool, arguments, Context::new()).await;
    response.unwrap().output
}

fn not_approved(output: &str) -> Value {
    let value: Value = serde_json::from_str(output).unwrap();
    assert_eq!(value["error"]["type"], "not_approved", "{value}");
    value
}

// PEER-CASES I5
#[tokio::test]
async fn approval_denies_a_sensitive_tool_with_a_result_the_model_sees() {
    let (kernel, runs) = approving(json!({ "default": "deny" }), false, None::<Answer>).await;
    let output = call(&kernel, "delete", json!({})).await;
    assert_eq!(not_approved(&output)["error"]["tool"], "delete");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the tool never ran");
}

// PEER-CASES I6
#[tokio::test]
async fn approval_lets_other_tools_run_untouched() {
    let (kernel, runs) = approving(json!({ "default": "deny" }), false, None::<Answer>).await;
    let output = call(&kernel, "list", json!({})).await;
    assert_eq!(
        (output.as_str(), runs.load(Ordering::SeqCst)),
        ("\"ran\"", 1)
    );
}

/// With `tools = "all"` every tool's calls are decided, sensitive or not,
/// as AgentScope's approval of all tools does.
#[tokio::test]
async fn approval_of_all_tools_decides_the_calls_of_every_tool() {
    let config = json!({ "default": "deny", "tools": "all" });
    let (kernel, runs) = approving(config, false, None::<Answer>).await;
    let output = call(&kernel, "list", json!({})).await;
    assert_eq!(not_approved(&output)["error"]["tool"], "list");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the tool never ran");
    let error = refused("approval", "approval", json!({ "tools": "some" })).await;
    assert!(error.to_string().contains("unknown variant"), "{error}");
}

// PEER-CASES I7
#[tokio::test]
async fn approval_runs_a_sensitive_tool_the_handler_approves() {
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    let approver = Box::new(move |request: &ApprovalRequest| {
        seen.lock().unwrap().push((
            request.tool.clone(),
            request.arguments.clone(),
            request.filter.to_string(),
        ));
        request.arguments["path"] == "/tmp/x"
    });
    let (kernel, runs) = approving(json!({}), true, Some(approver)).await;
    let output = call(&kernel, "delete", json!({ "path": "/tmp/x" })).await;
    assert_eq!(output, "\"done\"");
    let output = call(&kernel, "delete", json!({ "path": "/" })).await;
    assert!(
        not_approved(&output)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("denied by the approval handler")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let asked = asked.lock().unwrap();
    assert_eq!(
        asked[0],
        (
            "delete".to_owned(),
            json!({ "path": "/tmp/x" }),
            "approval".to_owned()
        )
    );
}

#[tokio::test]
async fn approval_rules_decide_by_tool_name_and_argument_pattern_before_asking() {
    let never = Box::new(|_: &ApprovalRequest| panic!("the rules decide; nobody is asked"));
    let config = json!({
        "rules": [
            { "tool": "del*", "args": "\"path\":\"/tmp/", "action": "allow" },
            { "tool": "delete", "action": "deny" },
        ],
    });
    let (kernel, runs) = approving(config, true, Some(never)).await;
    let output = call(&kernel, "delete", json!({ "path": "/tmp/a" })).await;
    assert_eq!(output, "\"done\"");
    let output = call(&kernel, "delete", json!({ "path": "/etc" })).await;
    not_approved(&output);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn approval_fails_closed_without_a_grant_or_a_handler() {
    for (grant, approver) in [
        (false, Some(Box::new(|_: &ApprovalRequest| true) as Answer)),
        (true, None),
    ] {
        let (kernel, runs) = approving(json!({ "default": "ask" }), grant, approver).await;
        let output = call(&kernel, "delete", json!({})).await;
        not_approved(&output);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "grant {grant}");
    }
}

#[tokio::test]
async fn an_approval_handler_that_panics_denies_and_the_host_goes_on() {
    let panics: Answer = Box::new(|_: &ApprovalRequest| panic!("the handler broke"));
    let (kernel, runs) = approving(json!({}), true, Some(panics)).await;
    let output = call(&kernel, "delete", json!({})).await;
    not_approved(&output);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let output = call(&kernel, "list", json!({})).await;
    assert_eq!(output, "\"ran\"", "the kernel still works");
    // A failed handler gets the timeout action, as in the seed.
    let panics: Answer = Box::new(|_: &ApprovalRequest| panic!("the handler broke"));
    let (kernel, runs) = approving(json!({ "on_timeout": "allow" }), true, Some(panics)).await;
    call(&kernel, "delete", json!({})).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn approval_applies_its_timeout_action_when_the_handler_does_not_answer() {
    struct Never;
    #[async_trait::async_trait]
    impl shallot::Approver for Never {
        async fn approve(&self, _: &ApprovalRequest) -> bool {
            std::future::pending().await
        }
    }
    for (action, runs_expected) in [("deny", 0), ("allow", 1)] {
        let config = json!({ "timeout_ms": 50, "on_timeout": action });
        let (kernel, runs) = approving(config, true, Some(Never)).await;
        let output = call(&kernel, "delete", json!({})).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            runs_expected,
            "{action}: {}",
            output
        );
    }
}

#[tokio::test]
async fn approval_denial_in_a_turn_reaches_the_model_as_the_tool_result() {
    let plugins = load(vec![spec(
        "approval",
        "approval",
        json!({ "default": "deny" }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("delete", json!({})),
        Reply::Text("understood".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .tool(
            ToolSpec::new("delete", "", json!({ "type": "object" })).sensitive(),
            |_: Value, _| async { Ok(json!("done")) },
        )
        .build()
        .unwrap();
    let done = done(kernel.turn(go("delete it"), Context::new()).await);
    assert_eq!(done.response.text(), "understood");
    let tool_message = model.requests()[1].messages.last().unwrap().text();
    not_approved(&tool_message);
}

#[tokio::test]
async fn approval_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (
            json!({ "rules": [{ "tool": "x", "args": "(", "action": "deny" }] }),
            "rules[0].args",
        ),
        (
            json!({ "rules": [{ "tool": "x", "action": "maybe" }] }),
            "unknown variant",
        ),
        (json!({ "on_timeout": "ask" }), "on_timeout"),
        (json!({ "rulez": [] }), "unknown field"),
    ] {
        let error = refused("approval", "approval", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

#[tokio::test]
async fn trace_writes_a_line_per_turn_chat_and_tool_call_to_the_operators_sink() {
    let path = trace_file("turn");
    let plugins = load(vec![granted(
        spec("trace", "trace", Value::Null),
        trace_grant(&path),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({ "x": 1 })),
        Reply::Text("done".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(
            ToolSpec::new("echo", "", json!({ "type": "object" })),
            |args: Value, _| async move { Ok(args) },
        )
        .build()
        .unwrap();
    let context = Context::new()
        .with("conversation_id", "c-7")
        .with(shallot::USER, "u-1")
        .with(shallot::CLIENT_KEY, "team-a");
    done(kernel.turn(go("hi"), context).await);
    let events = lines(&path);
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["chat", "tool", "chat", "turn"],
        "inner calls end first"
    );
    for event in &events {
        assert_eq!(event["filter"], "trace");
        assert_eq!(event["conversation_id"], "c-7");
        assert_eq!(
            (&event["user"], &event["key"]),
            (&json!("u-1"), &json!("team-a"))
        );
        assert!(
            event["ts"].as_u64().unwrap() > 0 && event["ms"].as_f64().unwrap() >= 0.0,
            "{event}"
        );
    }
    assert_eq!(events[0]["finish_reason"], "tool-use");
    assert_eq!(events[0]["tool_calls"], 1);
    assert_eq!(
        (
            events[1]["tool"].as_str(),
            events[1]["output_bytes"].as_u64()
        ),
        (Some("echo"), Some(7))
    );
    assert_eq!(events[3]["outcome"], "done");
    assert_eq!(events[3]["iterations"], 2);
}

#[tokio::test]
async fn trace_records_errors_and_never_changes_the_result() {
    let path = trace_file("error");
    let plugins = load(vec![granted(
        spec("trace", "trace", json!({ "turns": false })),
        trace_grant(&path),
    )])
    .await;
    let model = ScriptedModel::replies(vec![Reply::Fail(ChainError::new(
        ErrorKind::Auth,
        "bad key",
    ))]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Auth);
    let events = lines(&path);
    assert_eq!(events.len(), 1);
    assert_eq!(
        events[0]["error"],
        json!({ "kind": "auth", "message": "bad key" })
    );
}

#[tokio::test]
async fn trace_without_a_grant_writes_nothing_and_the_call_goes_on() {
    let plugins = load(vec![spec("trace", "trace", Value::Null)]).await;
    let kernel = shallot_tests::answering(&plugins, "fine");
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "fine"
    );
}

#[tokio::test]
async fn a_trace_file_that_cannot_be_opened_fails_the_load_naming_it() {
    let grants = Grants {
        trace: Some("/nonexistent-dir/trace.jsonl".into()),
        ..Grants::default()
    };
    let specs = vec![granted(spec("trace", "trace", Value::Null), grants)];
    let error = shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
        .await
        .err()
        .expect("refused");
    assert!(matches!(error, LoadError::Config { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("grants.trace: cannot open /nonexistent-dir/trace.jsonl"),
        "{error}"
    );
}

/// Streams a turn whose first round says "Let me look." and calls `echo`,
/// and whose second answers, through `final-answer`.
#[tokio::test]
async fn final_answer_shows_only_the_final_rounds_text_and_history_keeps_all() {
    let plugins = load(vec![spec("final_answer", "final-answer", Value::Null)]).await;
    let model = ScriptedModel::new(|call, _: &ChatRequest| match call {
        1 => Reply::Preamble("Let me look.".into(), vec![("echo".into(), json!({}))]),
        _ => Reply::Tokens(vec![
            ("The answer".into(), Some(r#"{"k":1}"#.into())),
            (" is 42.".into(), None),
        ]),
    });
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(
            ToolSpec::new("echo", "", json!({ "type": "object" })),
            |args: Value, _| async move { Ok(args) },
        )
        .build()
        .unwrap();
    let sink = Collector::default();
    let options = shallot::InvokeOptions::from(Context::new()).stream_to(sink.clone());
    let result = kernel.turn(go("q"), options).await;
    let TurnResult::Done(done) = result else {
        panic!("{result:?}")
    };
    assert_eq!(
        sink.tokens_with_meta(),
        [
            ("The answer".to_owned(), Some(r#"{"k":1}"#.to_owned())),
            (" is 42.".to_owned(), None),
        ]
    );
    let texts: Vec<String> = done.messages.iter().map(|m| m.text()).collect();
    assert!(
        texts.contains(&"Let me look.".to_owned()),
        "history keeps it: {texts:?}"
    );
}

/// The misbehave guest doing `action` in its chat hook, with `grants`
/// (and time enough for the bound under test to trip, not the clock: the
/// debug host measures megabytes slowly).
async fn abuse(action: &str, grants: Grants) -> ChainError {
    let (path, mut filter) = granted(
        spec("misbehave", "abuser", json!({ "on": "chat", "do": action })),
        grants,
    );
    filter.limits = shallot::Limits {
        cpu_ms: 10_000,
        wall_ms: 20_000,
        ..shallot::Limits::default()
    };
    let filter = (path, filter);
    let plugins = load(vec![filter]).await;
    shallot_tests::answering(&plugins, "ok")
        .chat(ask("hi"), Context::new())
        .await
        .unwrap_err()
}

#[tokio::test]
async fn a_granted_import_without_its_grant_is_refused_naming_the_grant() {
    for (action, grant) in [
        ("oversleep", "sleep_ms"),
        ("flood-trace", "trace"),
        ("ask", "approval"),
    ] {
        let error = abuse(action, Grants::default()).await;
        assert_eq!(error.kind, ErrorKind::Auth, "{action}: {error}");
        assert!(error.message.contains(grant), "{action}: {error}");
    }
}

#[tokio::test]
async fn sleeping_past_the_grant_is_refused_without_sleeping() {
    let error = abuse("oversleep", sleep_grant(1000)).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(
        error.message.contains("past its grant of 1000 ms"),
        "{error}"
    );
}

#[tokio::test]
async fn trace_floods_and_huge_events_are_bounded_and_the_host_fields_cannot_be_forged() {
    let path = trace_file("abuse");
    let error = abuse("flood-trace", trace_grant(&path)).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert_eq!(lines(&path).len(), 256);
    let error = abuse("huge-trace", trace_grant(&path)).await;
    assert!(error.message.contains("over the cap"), "{error}");
    let path = trace_file("forged");
    let filter = granted(
        spec(
            "misbehave",
            "abuser",
            json!({ "on": "chat", "do": "forge-trace" }),
        ),
        trace_grant(&path),
    );
    let plugins = load(vec![filter]).await;
    shallot_tests::answering(&plugins, "ok")
        .chat(ask("hi"), Context::new())
        .await
        .unwrap();
    let events = lines(&path);
    assert_eq!(events[0]["filter"], "abuser");
    assert!(events[0]["ts"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn an_approval_question_with_garbage_arguments_never_reaches_the_handler() {
    let asked = Arc::new(AtomicUsize::new(0));
    let counted = asked.clone();
    let filter = granted(
        spec(
            "misbehave",
            "abuser",
            json!({ "on": "chat", "do": "ask-garbage" }),
        ),
        Grants {
            approval: true,
            ..Grants::default()
        },
    );
    let plugins = load(vec![filter]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok"))
        .approver(move |_: &ApprovalRequest| {
            counted.fetch_add(1, Ordering::SeqCst);
            true
        })
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
    assert_eq!(asked.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_conversation_store_cannot_be_flooded_or_hammered_from_one_call() {
    let store = || Grants {
        memory: Some(":memory:".into()),
        ..Grants::default()
    };
    let error = abuse("memory-flood", store()).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("host memory cap"), "{error}");
    let kept = shallot::open_store(":memory:")
        .await
        .unwrap()
        .load("flooded", usize::MAX)
        .await
        .unwrap();
    let kept: usize = kept.iter().map(|m| m.text().len()).sum();
    assert!(
        kept <= 64 << 20,
        "no more than the cap reached the store: {kept}"
    );
    let error = abuse("memory-chatter", store()).await;
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(
        error.message.contains("64 conversation-store operations"),
        "{error}"
    );
    let error = abuse("memory-long-id", store()).await;
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
    assert!(error.message.contains("1 to 512 bytes"), "{error}");
}

/// A token transformer's quotas are its stream's, not each step's: one
/// that sleeps 10 ms a step under a 50 ms grant is refused at its sixth
/// step, where each step starting afresh would sleep without end.
#[tokio::test]
async fn a_token_transformer_sleeps_its_grant_once_a_stream_not_once_a_step() {
    let filter = granted(
        spec("misbehave", "bad", json!({ "on": "step", "do": "nap" })),
        sleep_grant(50),
    );
    let plugins = load(vec![filter]).await;
    let tokens: Vec<String> = (0..20).map(|i| format!("t{i} ")).collect();
    let model = ScriptedModel::replies(vec![Reply::Paced(
        tokens,
        std::time::Duration::from_millis(10),
    )]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    let seen = Collector::default();
    let error = kernel
        .chat_stream(ask("hi"), Context::new(), seen.clone())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(seen.tokens().len() < 20, "{:?}", seen.tokens());
}

/// Questions to the approval handler are capped per call: a filter asking
/// in a loop is refused after sixteen, and the handler hears no more.
#[tokio::test]
async fn approval_questions_are_capped_per_call() {
    let filter = granted(
        spec(
            "misbehave",
            "bad",
            json!({ "on": "chat", "do": "ask-flood" }),
        ),
        Grants {
            approval: true,
            ..Grants::default()
        },
    );
    let plugins = load(vec![filter]).await;
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .approver(move |_: &ApprovalRequest| {
            counter.fetch_add(1, Ordering::SeqCst);
            true
        })
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("approval questions"), "{error}");
    assert_eq!(asked.load(Ordering::SeqCst), 16);
}

/// `rate-limit` named `name` with `config`, its counters in `store`.
fn rate_limit(name: &str, config: Value, store: &str) -> (PathBuf, FilterSpec) {
    granted(
        spec("rate_limit", name, config),
        Grants {
            kv: Some(shallot::StoreSpec::from(store).into()),
            ..Grants::default()
        },
    )
}

/// A request of `user`'s: whether it passed, and what the limit said.
async fn limited(kernel: &Kernel, user: &str) -> (Result<(), ChainError>, Value) {
    let context = Context::new().with(shallot::USER, user);
    let passed = kernel.chat(ask("hi"), context.clone()).await.map(drop);
    (passed, context.get(shallot::RATE_LIMIT).unwrap_or_default())
}

#[tokio::test]
async fn rate_limit_passes_exactly_its_limit_of_concurrent_requests_per_bucket() {
    let redis = shallot_tests::RedisServer::start();
    for store in shallot_tests::every_store("granted-rate-limit", &redis) {
        let config = json!({ "requests": 7, "window_s": 3600, "by": "user" });
        let plugins = load(vec![rate_limit("limit", config, &store)]).await;
        let kernel = shallot_tests::answering(&plugins, "ok");
        let asked = (0..20).map(|_| limited(&kernel, "dana"));
        let answers = futures::future::join_all(asked).await;
        let passed = answers.iter().filter(|(passed, _)| passed.is_ok()).count();
        assert_eq!(passed, 7, "{store}: {answers:?}");
        for (answer, seen) in &answers {
            if let Err(error) = answer {
                assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
                assert!(
                    error
                        .message
                        .contains("rate limit of 7 requests per 3600 s"),
                    "{error}"
                );
                assert_eq!(seen["requests"]["remaining"], 0, "{seen}");
                let reset = seen["requests"]["reset_ms"].as_u64().unwrap();
                assert!(reset > 3_500_000 && reset <= 3_600_000, "{seen}");
            }
        }
        let (other, seen) = limited(&kernel, "eve").await;
        assert!(other.is_ok(), "{store}: a bucket of its own");
        assert_eq!(seen["requests"]["remaining"], 6, "{seen}");
    }
}

#[tokio::test]
async fn rate_limit_counts_a_turn_once_however_many_model_calls_it_makes() {
    let config = json!({ "requests": 2, "window_s": 60, "by": "user" });
    let plugins = load(vec![rate_limit("limit", config, ":memory:turns")]).await;
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({})),
        Reply::call("echo", json!({})),
        Reply::Text("done".into()),
        Reply::Text("again".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap();
    let user = || shallot::InvokeOptions::from(Context::new().with(shallot::USER, "fay"));
    done(kernel.turn(go("three rounds"), user()).await);
    assert_eq!(model.calls(), 3);
    done(kernel.turn(go("one round"), user()).await);
    let TurnResult::Error(refused) = kernel.turn(go("over"), user()).await else {
        panic!("the third turn is over the limit");
    };
    assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{refused}");
    assert_eq!(model.calls(), 4, "refused before the model is called");
}

#[tokio::test]
async fn rate_limit_spends_the_tokens_the_model_reports() {
    // The embedded model's answer to "hi" uses 4 tokens.
    let config = json!({ "tokens": 3, "window_s": 60, "by": "user" });
    let plugins = load(vec![rate_limit("limit", config, ":memory:tokens")]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(shallot::EmbeddedModel::new())
        .build()
        .unwrap();
    let (first, seen) = limited(&kernel, "gus").await;
    first.unwrap();
    assert_eq!(
        seen["tokens"]["remaining"], 3,
        "nothing spent before the answer: {seen}"
    );
    let (second, seen) = limited(&kernel, "gus").await;
    assert!(
        second
            .as_ref()
            .is_err_and(|e| e.message.contains("3 tokens")),
        "the first answer spent the window's tokens: {second:?} {seen}"
    );
}

/// Several windows, each a `rate-limit` of its own (here requests per
/// minute around tokens per day), are all or nothing: a request the inner
/// window refuses gives back its place in the outer one.
#[tokio::test]
async fn stacked_windows_are_all_or_nothing() {
    let minute = json!({ "requests": 3, "window_s": 60, "by": "user" });
    let day = json!({ "tokens": 3, "window_s": 86_400, "by": "user" });
    let plugins = load(vec![
        rate_limit("per-minute", minute, ":memory:stacked"),
        rate_limit("per-day", day, ":memory:stacked"),
    ])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(shallot::EmbeddedModel::new())
        .build()
        .unwrap();
    // The embedded model's answer to "hi" uses 4 tokens: the day's.
    let (first, seen) = limited(&kernel, "uma").await;
    first.unwrap();
    assert_eq!(seen["requests"]["remaining"], 2, "{seen}");
    for _ in 0..3 {
        let (refused, seen) = limited(&kernel, "uma").await;
        let refused = refused.unwrap_err();
        assert!(
            refused.message.contains("3 tokens per 86400 s"),
            "{refused}"
        );
        assert_eq!(
            seen["requests"]["remaining"], 1,
            "the minute counts only what the day let through: {seen}"
        );
    }
}

/// One `rate-limit` with several `limits` decides them in one take: a
/// request the hour refuses is not counted in the minute either.
#[tokio::test]
async fn one_rate_limit_decides_its_windows_together() {
    let redis = shallot_tests::RedisServer::start();
    for store in shallot_tests::every_store("granted-limits", &redis) {
        let config = json!({ "by": "user", "limits": [
            { "requests": 5, "window_s": 60 },
            { "requests": 2, "window_s": 3600, "window": "sliding" },
        ] });
        let plugins = load(vec![rate_limit("limits", config, &store)]).await;
        let kernel = shallot_tests::answering(&plugins, "ok");
        for remaining in [1, 0] {
            let (passed, seen) = limited(&kernel, "val").await;
            passed.unwrap();
            assert_eq!(
                seen["requests"]["remaining"], remaining,
                "{store}: the tighter window: {seen}"
            );
        }
        for _ in 0..3 {
            let (refused, _) = limited(&kernel, "val").await;
            let refused = refused.unwrap_err();
            assert!(
                refused.message.contains("2 requests per 3600 s"),
                "{store}: {refused}"
            );
        }
        let kept = shallot::open_kv(store.as_str()).await.unwrap();
        let minute = kept
            .get("limits", "requests:user:val:per-60s")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            minute.value, "2",
            "{store}: the minute counts only what the hour let through"
        );
    }
}

#[tokio::test]
async fn filters_naming_one_kv_namespace_share_its_keys() {
    let shared = |name: &str| {
        let (path, mut spec) = rate_limit(
            name,
            json!({ "requests": 3, "window_s": 60, "by": "user" }),
            ":memory:namespaces",
        );
        spec.grants.kv.as_mut().unwrap().namespace = Some("limits".into());
        (path, spec)
    };
    let plugins = load(vec![shared("one"), shared("two")]).await;
    let kernel = shallot_tests::answering(&plugins, "ok");
    // Each request counts twice in the one counter: the second is the
    // fourth count.
    assert!(limited(&kernel, "hal").await.0.is_ok());
    assert!(limited(&kernel, "hal").await.0.is_err());
    let apart = vec![
        rate_limit(
            "one",
            json!({ "requests": 3, "by": "user" }),
            ":memory:namespaces",
        ),
        rate_limit(
            "two",
            json!({ "requests": 3, "by": "user" }),
            ":memory:namespaces",
        ),
    ];
    let kernel = shallot_tests::answering(&load(apart).await, "ok");
    for _ in 0..3 {
        assert!(
            limited(&kernel, "hal").await.0.is_ok(),
            "each its own namespace"
        );
    }
}

#[tokio::test]
async fn rate_limit_refuses_a_bad_configuration_and_runs_nothing_without_its_grant() {
    for (config, says) in [
        (
            json!({ "window_s": 60 }),
            "give `requests`, `tokens` or both",
        ),
        (json!({ "requests": 1, "window_s": 0 }), "at least 1"),
        (
            json!({ "requests": 1, "limits": [{ "requests": 1, "window_s": 60 }] }),
            "not both",
        ),
        (
            json!({ "limits": [{ "requests": 1, "window_s": 60 }, { "tokens": 9, "window_s": 60 }] }),
            "two `limits` of one 60 s window",
        ),
        (json!({ "limits": [{ "window_s": 60 }] }), "give `requests`"),
    ] {
        let error = refused("rate_limit", "limit", config).await.to_string();
        assert!(error.contains(says), "{error}");
    }
    let plugins = load(vec![spec("rate_limit", "limit", json!({ "requests": 1 }))]).await;
    let error = shallot_tests::answering(&plugins, "ok")
        .chat(ask("hi"), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Auth, "{error}");
    assert!(error.message.contains("kv ="), "{error}");
}

#[tokio::test]
async fn a_sliding_window_carries_the_previous_windows_count() {
    let config = json!({ "requests": 2, "window_s": 3600, "window": "sliding", "by": "user" });
    let plugins = load(vec![rate_limit("limit", config, ":memory:sliding")]).await;
    let kernel = shallot_tests::answering(&plugins, "ok");
    let store = shallot::open_kv(":memory:sliding").await.unwrap();
    // The previous hour held two requests: some of that weight is still in
    // the last hour, so only what is left of the limit passes.
    let hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        / 3_600_000;
    let previous = format!("requests:user:ivy:{}", hour - 1);
    store
        .set("limit", None, &previous, "2", None)
        .await
        .unwrap();
    let (first, seen) = limited(&kernel, "ivy").await;
    let reset = seen["requests"]["reset_ms"].as_u64().unwrap();
    assert!(reset <= 3_600_000, "{seen}");
    // The previous hour weighs by the part of it still within the last
    // hour, the time this one has left: most of the hour, one request.
    let carried = 2 * reset / 3_600_000;
    let used = carried + 1;
    assert_eq!(
        seen["requests"]["remaining"],
        2u64.saturating_sub(used),
        "{seen}"
    );
    assert_eq!(first.is_ok(), used <= 2, "{seen}");
}

/// `budget` with `config`, its spend in `store`.
fn budget(config: Value, store: &str) -> (PathBuf, FilterSpec) {
    granted(
        spec("budget", "budget", config),
        Grants {
            kv: Some(shallot::StoreSpec::from(store).into()),
            ..Grants::default()
        },
    )
}

#[tokio::test]
async fn budget_refuses_a_bucket_once_its_period_is_spent_streamed_answers_counted_too() {
    // The embedded model's answer to "hi" uses 4 tokens: a dollar a call.
    let config = json!({
        "limit_usd": 3, "period": "month", "by": "user",
        "prices": { "*": { "input": 250_000, "output": 250_000 } },
    });
    let plugins = load(vec![budget(config, ":memory:budget")]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(shallot::EmbeddedModel::new())
        .build()
        .unwrap();
    let as_user = |user: &str| Context::new().with(shallot::USER, user);
    kernel.chat(ask("hi"), as_user("joe")).await.unwrap();
    let sink = Collector::default();
    kernel
        .chat_stream(ask("hi"), as_user("joe"), sink.clone())
        .await
        .unwrap();
    let context = as_user("joe");
    kernel.chat(ask("hi"), context.clone()).await.unwrap();
    let seen = context.get(shallot::RATE_LIMIT).unwrap();
    assert_eq!(
        seen["budget"]["remaining"], 0,
        "three dollars spent: {seen}"
    );
    let reset = seen["budget"]["reset_ms"].as_u64().unwrap();
    assert!(
        reset > 0 && reset <= 31 * 86_400_000,
        "the month's end: {seen}"
    );
    let refused = kernel.chat(ask("hi"), as_user("joe")).await.unwrap_err();
    assert_eq!(refused.kind, ErrorKind::LimitExceeded, "{refused}");
    assert!(
        refused.message.contains("budget of $3.00 a month is spent"),
        "{refused}"
    );
    kernel.chat(ask("hi"), as_user("kim")).await.unwrap();
}

#[tokio::test]
async fn budget_refuses_a_bad_configuration_at_load_and_keeps_its_periods_without_the_clock() {
    let prices = json!({ "*": { "input": 1, "output": 1 } });
    for (config, says) in [
        (
            json!({ "limit_usd": 0, "prices": prices }),
            "positive amount",
        ),
        (
            json!({ "limit_usd": 1, "prices": { "m": { "input": -1, "output": 1 } } }),
            "0 or more",
        ),
        (json!({ "limit_usd": 1 }), "prices"),
    ] {
        let error = refused("budget", "budget", config).await.to_string();
        assert!(error.contains(says), "{error}");
    }
    // The periods are the store's calendar: the filter needs no clock.
    let dollar =
        json!({ "limit_usd": 1, "prices": { "*": { "input": 250_000, "output": 250_000 } } });
    let plugins = load(vec![budget(dollar, ":memory:no-clock")]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(shallot::EmbeddedModel::new())
        .build()
        .unwrap();
    kernel.chat(ask("hi"), Context::new()).await.unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("renews in"), "{error}");
}

/// A kernel with `cache` (its entries in `store`) over `model`.
async fn cached(model: ScriptedModel, store: &str) -> Kernel {
    let filter = granted(
        spec("cache", "cache", json!({ "ttl_s": 60 })),
        Grants {
            kv: Some(shallot::StoreSpec::from(store).into()),
            ..Grants::default()
        },
    );
    let plugins = load(vec![filter]).await;
    Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap()
}

/// What the cache did for one chat of `request` by `tenant`, and its text.
async fn through_cache(kernel: &Kernel, request: ChatRequest, tenant: &str) -> (Value, String) {
    let context = Context::new().with(shallot::TENANT, tenant);
    let response = kernel.chat(request, context.clone()).await.unwrap();
    (
        context.get(shallot::CACHE).unwrap_or_default(),
        response.text(),
    )
}

/// A cache whose namespace is full (each namespace has its cap in every
/// store) delivers the model's answer, unkept, rather than failing it.
#[tokio::test]
async fn a_full_cache_delivers_the_models_answer_unkept() {
    let store = shallot::open_kv(":memory:full-cache").await.unwrap();
    let mut n = 0;
    while store
        .set("cache", None, &format!("k{n}"), "", None)
        .await
        .is_ok()
    {
        n += 1;
    }
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer {n}")));
    let kernel = cached(model.clone(), ":memory:full-cache").await;
    for n in 1..=2 {
        assert_eq!(
            through_cache(&kernel, ask("hi"), "t").await,
            (json!("miss"), format!("answer {n}")),
            "answered by the model, not kept"
        );
    }
}

#[tokio::test]
async fn cache_answers_the_same_request_again_without_the_model() {
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer {n}")));
    let kernel = cached(model.clone(), ":memory:cache").await;
    assert_eq!(
        through_cache(&kernel, ask("hi"), "t").await,
        (json!("miss"), "answer 1".into())
    );
    assert_eq!(
        through_cache(&kernel, ask("hi"), "t").await,
        (json!("hit"), "answer 1".into())
    );
    assert_eq!(model.calls(), 1, "the second answer is the cache's");
    // Streamed, the answer is the cache's too (the gateway streams a
    // filter's answer to its client: `serve_streams_a_cached_answer`).
    let context = Context::new().with(shallot::TENANT, "t");
    let streamed = kernel
        .chat_stream(ask("hi"), context.clone(), Collector::default())
        .await
        .unwrap();
    assert_eq!(streamed.text(), "answer 1");
    assert_eq!(context.get(shallot::CACHE), Some(json!("hit")));
    assert_eq!(model.calls(), 1);
    // Another request, another tenant: the model again.
    assert_eq!(
        through_cache(&kernel, ask("hello"), "t").await.0,
        json!("miss")
    );
    assert_eq!(
        through_cache(&kernel, ask("hi"), "other").await,
        (json!("miss"), "answer 3".into())
    );
    assert_eq!(
        model.calls(),
        3,
        "no tenant is answered from another's cache"
    );
}

#[tokio::test]
async fn a_request_opts_out_of_the_cache_and_the_option_never_reaches_the_model() {
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer {n}")));
    let kernel = cached(model.clone(), ":memory:cache-opt-out").await;
    let fresh = || {
        let mut request = ask("hi");
        request
            .options_mut()
            .extra
            .insert("cache".into(), json!(false));
        request
    };
    assert_eq!(
        through_cache(&kernel, fresh(), "t").await,
        (json!("skip"), "answer 1".into())
    );
    assert_eq!(
        through_cache(&kernel, ask("hi"), "t").await.0,
        json!("miss"),
        "a skip writes nothing"
    );
    assert_eq!(
        through_cache(&kernel, fresh(), "t").await,
        (json!("skip"), "answer 3".into())
    );
    assert!(
        model
            .requests()
            .iter()
            .all(|r| r.options.extra.get("cache").is_none()),
        "the cache's option is its own"
    );
}

#[tokio::test]
async fn cache_keeps_only_whole_text_answers() {
    let model = ScriptedModel::new(|_, _| Reply::call("echo", json!({})));
    let kernel = cached(model.clone(), ":memory:cache-tools").await;
    through_cache(&kernel, ask("hi"), "t").await;
    assert_eq!(
        through_cache(&kernel, ask("hi"), "t").await.0,
        json!("miss")
    );
    assert_eq!(model.calls(), 2, "an answer that calls tools is not kept");
    for (config, says) in [
        (json!({ "ttl_s": 0 }), "at least 1"),
        (json!({ "max_bytes": 2_000_000 }), "at most 1 MiB"),
    ] {
        let error = refused("cache", "cache", config).await.to_string();
        assert!(error.contains(says), "{error}");
    }
}

/// A filter granted an origin reaches it with `wasi:http` (through wstd,
/// as a Rust filter would): a GET, a POST with its body, as many requests
/// as the grant allows. Time waiting for a response is not the filter's
/// own: a response that takes longer than the filter's whole `wall_ms`
/// still arrives, within the grant's `timeout_ms`.
#[tokio::test]
async fn a_filter_reaches_its_granted_origin_and_waiting_is_not_its_own_time() {
    let service = shallot_tests::WebService::start().await;
    let grant = shallot_tests::http_grant(&[&service.origin()]);
    // The default own wall clock, 1 s: the trickle takes 2 s.
    let limits = Limits::default();
    let fetch = |config| shallot_tests::fetch(config, Some(grant.clone()), limits);
    let lines = fetch(json!({ "url": service.url("/hello"), "times": 2 }))
        .await
        .unwrap();
    assert_eq!(lines, ["200 22 hello from the service"; 2]);
    let lines = fetch(json!({ "url": service.url("/echo"), "body_bytes": 5000 }))
        .await
        .unwrap();
    assert_eq!(lines, ["200 4 5000"]);
    let lines = fetch(json!({ "url": service.url("/trickle?bytes=40") }))
        .await
        .unwrap();
    assert_eq!(lines, [format!("200 40 {}", "t".repeat(40))]);
}

/// A conversation past `summarize`'s trigger: the older messages become
/// one summary from a side call to the granted model, which no filter and
/// no stream sees; the system prompt and the latest messages stay, and the
/// cut moves back so that a tool call and its result stay together.
#[tokio::test]
async fn summarize_replaces_the_older_messages_by_a_side_call_summary_keeping_tool_pairs_whole() {
    use shallot::types::{Message, Role, ToolCall};
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        if request.messages[0].text().starts_with("Summarize") {
            Reply::Text("SUMMARY: they asked twice".into())
        } else {
            Reply::Text("ok".into())
        }
    });
    let (path, mut summarize) = spec(
        "summarize",
        "summarize",
        json!({ "trigger_tokens": 10, "keep": 3 }),
    );
    summarize.grants.model = Some(shallot::ModelGrant::of("default"));
    let counter = spec("probe", "outer", json!({ "count": true, "tag": "outer" }));
    let plugins = load(vec![counter, (path.clone(), summarize.clone())]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let mut call = Message::new(Role::Assistant, "");
    call.content = None;
    call.tool_calls = vec![ToolCall {
        id: "c1".into(),
        name: "weather".into(),
        arguments: "{}".into(),
    }];
    let conversation = vec![
        Message::system("You are helpful."),
        Message::user("What is the capital of France? I have asked this before."),
        Message::assistant("Paris, as it was the last time you asked."),
        Message::user("And the weather there?"),
        call.clone(),
        Message::tool_result("c1", "sunny"),
        Message::assistant("It is sunny."),
        Message::user("Thanks, and now?"),
    ];
    let sink = Collector::default();
    let context = Context::new();
    let answer = kernel
        .chat_stream(
            ChatRequest::new(conversation.clone()),
            context.clone(),
            sink.clone(),
        )
        .await
        .unwrap();
    assert_eq!(answer.text(), "ok");
    assert_eq!(sink.text(), "ok", "the side call is never streamed");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    let side = &requests[0];
    assert_eq!(side.messages.len(), 2);
    assert!(
        side.messages[1].text().contains("capital of France"),
        "{:?}",
        side.messages
    );
    assert!(
        !side.messages[1].text().contains("It is sunny"),
        "kept messages are not summarized"
    );
    assert!(side.messages.iter().all(|m| m.text() != "You are helpful."));
    assert_eq!(side.options.max_tokens, Some(512));
    let main = &requests[1];
    assert_eq!(main.messages[0].text(), "You are helpful.");
    assert_eq!(
        main.messages[1].text(),
        "Summary of the earlier conversation: SUMMARY: they asked twice"
    );
    assert_eq!(
        main.messages[2..],
        conversation[4..],
        "the tool call stays with its result"
    );
    assert_eq!(
        context.get("summarize").unwrap(),
        json!({ "summarized": 3, "kept": 4 })
    );
    let outer = context.get("fctx:outer").unwrap();
    assert_eq!(outer["n"], 1, "the filter outside saw one chat: {outer}");

    summarize.grants.model = None;
    let plugins = load(vec![(path, summarize)]).await;
    let error = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok"))
        .build()
        .unwrap()
        .chat(ChatRequest::new(conversation), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Auth, "{error}");
    assert!(error.message.contains("model ="), "{error}");
}
