//! Human in the loop: a sensitive tool pauses the turn, and
//! `Kernel::resume` approves or denies the pending calls and continues it,
//! through the turn filters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use shallot::ErrorKind;
use shallot::types::Decision;
use shallot::types::{Message, Role, ToolSpec, TurnInterrupt, TurnResult};
use shallot::{Context, Kernel, LoopConfig, MemoryHistory, ToolLoop};
use shallot_tests::{Reply, ScriptedModel, load, spec};

use crate::agent::{done, go, reviser, tool_texts};

/// A kernel that pauses before the sensitive `delete` tool; `delete` and
/// `list` count their runs.
fn approval_kernel(
    plugins: &shallot::PluginSet,
    model: ScriptedModel,
) -> (Kernel, Arc<AtomicUsize>) {
    let deleted = Arc::new(AtomicUsize::new(0));
    let counter = deleted.clone();
    let config = LoopConfig {
        pause_sensitive: true,
        ..LoopConfig::default()
    };
    let kernel = Kernel::builder()
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
        )
        .build()
        .unwrap();
    (kernel, deleted)
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

/// O47: a pause continues once. Resuming a clone of its interrupt again
/// (a retried request, a double click) is an error, not a second run of
/// the sensitive call; a resume of an interrupt that holds no pause too.
#[tokio::test]
async fn o47_a_pause_is_resumed_once_and_a_second_resume_is_an_error() {
    let mut replies = delete_and_list();
    replies.push(Reply::Text("again".into()));
    let model = ScriptedModel::replies(replies);
    let (kernel, deleted) = approval_kernel(&shallot::PluginSet::default(), model.clone());
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

/// O41: a pause keeps the shared context: a tool that wrote beside the
/// paused call, and a resume given a fresh context, still lets the next
/// round's reader see it.
#[tokio::test]
async fn o41_a_resumed_turn_sees_what_tools_wrote_before_the_pause() {
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
    let (kernel, deleted) = approval_kernel(&shallot::PluginSet::default(), model.clone());
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

#[tokio::test]
async fn h5_a_turn_filter_may_reenter_after_the_resumed_turn() {
    let plugins = load(vec![reviser(1)]).await;
    let mut replies = delete_and_list();
    replies[1] = Reply::Text("answer-1".into());
    replies.push(Reply::Text("good".into()));
    let model = ScriptedModel::replies(replies);
    let (kernel, _) = approval_kernel(&plugins, model.clone());
    let TurnResult::Interrupt(interrupt) = kernel.turn(go("clean up"), Context::new()).await else {
        panic!("the filter passes the interrupt through")
    };
    let done = done(
        kernel
            .resume(interrupt, Decision::Approve, Context::new())
            .await,
    );
    assert_eq!(
        done.response.text(),
        "good",
        "the re-entry ran a fresh loop, not the paused turn again"
    );
    assert_eq!(model.calls(), 3);
}
