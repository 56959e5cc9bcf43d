//! The turn chain's composition (PEER-CASES H, for what does not need the
//! tool loop; the loop itself comes with the agent).

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::json;
use shallot::types::{Message, TurnDone, TurnInterrupt, TurnRequest, TurnResult};
use shallot::{Context, Invoke, Kernel, Terminal, Turn};
use shallot_tests::{ScriptedModel, load, spec, strings};

fn kernel(plugins: &shallot::FilterSet, model: ScriptedModel) -> Kernel {
    Kernel::builder()
        .plugins(plugins)
        .model(model)
        .build()
        .unwrap()
}

fn go() -> TurnRequest {
    TurnRequest::new(vec![Message::user("go")])
}

// PEER-CASES H1
#[tokio::test]
async fn a_turn_filter_adds_a_message_the_model_sees() {
    let plugins = load(vec![spec(
        "probe",
        "rag",
        json!({ "system": "CONTEXT", "hooks": ["turn"] }),
    )])
    .await;
    let model = ScriptedModel::answer("answer-1");
    let result = kernel(&plugins, model.clone())
        .turn(go(), Context::new())
        .await;
    assert!(matches!(result, TurnResult::Done(_)));
    assert_eq!(model.calls(), 1);
    assert!(
        model.requests()[0]
            .messages
            .iter()
            .any(|m| m.text() == "CONTEXT")
    );
}

// PEER-CASES H2
#[tokio::test]
async fn a_turn_filter_sees_the_done_result_with_the_run_messages() {
    let plugins = load(vec![spec(
        "probe",
        "observer",
        json!({ "tag": "o", "hooks": ["turn"] }),
    )])
    .await;
    let result = kernel(&plugins, ScriptedModel::answer("answer-1"))
        .turn(go(), Context::new())
        .await;
    let TurnResult::Done(done) = result else {
        panic!("expected done, got {result:?}")
    };
    assert_eq!(done.response.text(), "answer-1");
    assert_eq!(done.iterations, 1);
    let texts: Vec<String> = done.messages.iter().map(Message::text).collect();
    assert_eq!(texts, ["go", "answer-1"]);
}

// PEER-CASES H4
#[tokio::test]
async fn turn_filters_nest_in_list_order() {
    let plugins = load(vec![
        spec(
            "probe",
            "outer",
            json!({ "tag": "outer", "hooks": ["turn"] }),
        ),
        spec(
            "probe",
            "inner",
            json!({ "tag": "inner", "hooks": ["turn"] }),
        ),
    ])
    .await;
    let context = Context::new();
    kernel(&plugins, ScriptedModel::answer("ok"))
        .turn(go(), context.clone())
        .await;
    assert_eq!(
        strings(&context, "trace"),
        ["outer_before", "inner_before", "inner_after", "outer_after"]
    );
}

// PEER-CASES H6
#[tokio::test]
async fn a_turn_filter_sees_the_resume_flag() {
    let plugins = load(vec![spec(
        "probe",
        "probe",
        json!({ "record_resume": true, "hooks": ["turn"] }),
    )])
    .await;
    let kernel = kernel(&plugins, ScriptedModel::answer("ok"));
    let context = Context::new();
    kernel.turn(go(), context.clone()).await;
    let resumed = TurnRequest {
        resume: true,
        ..go()
    };
    kernel.turn(resumed, context.clone()).await;
    assert_eq!(context.get("resume"), Some(json!([false, true])));
}

/// A tool loop that pauses, or fails, every turn.
struct Pausing(bool);

#[async_trait]
impl Terminal<Turn> for Pausing {
    async fn call(&self, _: TurnRequest, _: &Arc<Invoke>, _: &Context) -> TurnResult {
        if self.0 {
            TurnResult::Interrupt(TurnInterrupt::new("needs approval", None))
        } else {
            TurnResult::Error(shallot::ChainError::new(
                shallot::ErrorKind::Transient,
                "loop failed",
            ))
        }
    }
}

#[tokio::test]
async fn interrupt_and_error_pass_through_turn_filters_untouched() {
    // A filter that would re-enter on a done result (calls: 3) must not on these.
    let plugins = load(vec![spec(
        "probe",
        "retry",
        json!({ "tag": "r", "calls": 3, "hooks": ["turn"] }),
    )])
    .await;
    for pause in [true, false] {
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .turn_terminal(Pausing(pause))
            .build()
            .unwrap();
        let context = Context::new();
        let result = kernel.turn(go(), context.clone()).await;
        match result {
            TurnResult::Interrupt(interrupt) => {
                assert!(pause && interrupt.reason == "needs approval")
            }
            TurnResult::Error(error) => {
                let terminal = Some(shallot::Origin::terminal("turn"));
                assert!(!pause && error.message == "loop failed" && error.origin == terminal)
            }
            TurnResult::Done(_) => panic!("neither pausing nor failing produced a done result"),
        }
        assert_eq!(strings(&context, "trace"), ["r_before", "r_after"]);
    }
}

#[tokio::test]
async fn a_turn_filter_may_answer_without_running_the_loop() {
    let plugins = load(vec![spec(
        "probe",
        "cache",
        json!({ "tag": "cache", "short_circuit": true, "hooks": ["turn"] }),
    )])
    .await;
    let model = ScriptedModel::answer("never");
    let result = kernel(&plugins, model.clone())
        .turn(go(), Context::new())
        .await;
    let TurnResult::Done(TurnDone { response, .. }) = result else {
        panic!("expected done")
    };
    assert_eq!(response.text(), "short:cache");
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn a_filter_with_turn_and_chat_hooks_runs_in_both_without_reentering_an_instance() {
    let both = spec(
        "probe",
        "both",
        json!({ "tag": "b", "hooks": ["turn", "chat"] }),
    );
    let plugins = load(vec![both]).await;
    let context = Context::new();
    let result = kernel(&plugins, ScriptedModel::answer("ok"))
        .turn(go(), context.clone())
        .await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    assert_eq!(
        strings(&context, "trace"),
        ["b_before", "b_before", "b_after", "b_after"]
    );
}
