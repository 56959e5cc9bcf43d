//! Private filter context, FCtx (PEER-CASES C; unlike the peer, one state
//! per filter per invoke, shared by its turn, chat and tool hooks).

use serde_json::json;
use shallot::types::ToolSpec;
use shallot::types::{TurnRequest, TurnResult};
use shallot::{Context, Kernel};
use shallot_tests::{Reply, ScriptedModel, answering, chat_context, load, spec};

// PEER-CASES C1
#[tokio::test]
async fn each_filter_has_its_own_state_under_the_same_key() {
    let plugins = load(vec![
        spec("probe", "a", json!({ "tag": "a", "count": true })),
        spec("probe", "b", json!({ "tag": "b", "count": true })),
    ])
    .await;
    let context = chat_context(&answering(&plugins, "ok")).await;
    assert_eq!(context.get("fctx:a"), Some(json!({ "n": 1 })));
    assert_eq!(context.get("fctx:b"), Some(json!({ "n": 1 })));
}

// PEER-CASES C2
#[tokio::test]
async fn state_lives_for_one_invoke_only() {
    let plugins = load(vec![spec(
        "probe",
        "c",
        json!({ "tag": "c", "count": true }),
    )])
    .await;
    let kernel = answering(&plugins, "ok");
    for _ in 0..2 {
        let context = chat_context(&kernel).await;
        assert_eq!(
            context.get("fctx:c"),
            Some(json!({ "n": 1 })),
            "a new invoke starts from init"
        );
    }
}

// PEER-CASES C3
#[tokio::test]
async fn init_seeds_the_state_on_first_entry() {
    let plugins = load(vec![spec(
        "probe",
        "s",
        json!({ "tag": "s", "mark": true, "init": { "seed": 42 } }),
    )])
    .await;
    let context = chat_context(&answering(&plugins, "ok")).await;
    assert_eq!(
        context.get("fctx:s"),
        Some(json!({ "seed": 42, "seen": true }))
    );
}

// PEER-CASES C5
#[tokio::test]
async fn a_hook_that_returns_only_a_response_keeps_the_state() {
    // `calls: 2` makes the outer counter's inner twin run twice; the outer
    // one, which only reads, must not reset what it counted before.
    let plugins = load(vec![
        spec(
            "probe",
            "keeper",
            json!({ "tag": "k", "count": true, "calls": 2 }),
        ),
        spec("probe", "plain", json!({})),
    ])
    .await;
    let context = chat_context(&answering(&plugins, "ok")).await;
    assert_eq!(context.get("fctx:k"), Some(json!({ "n": 1 })));
}

#[tokio::test]
async fn one_state_is_shared_by_a_filters_turn_chat_and_tool_hooks() {
    let counter = spec("probe", "counter", json!({ "tag": "x", "count": true }));
    let other = spec(
        "probe",
        "other",
        json!({ "tag": "y", "count": true, "hooks": ["chat"] }),
    );
    let plugins = load(vec![counter, other]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![
            Reply::call("noop", json!({})),
            Reply::Text("ok".into()),
        ]))
        .tool(
            ToolSpec::new("noop", "", json!({"type": "object"})),
            |_, _| async { Ok(json!(null)) },
        )
        .build()
        .unwrap();
    let context = Context::new();
    let result = kernel
        .turn(
            TurnRequest::new(vec![shallot::types::Message::user("go")]),
            context.clone(),
        )
        .await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    // around-turn, two model rounds and one tool call, all one state.
    assert_eq!(context.get("fctx:x"), Some(json!({ "n": 4 })));
    assert_eq!(
        context.get("fctx:y"),
        Some(json!({ "n": 2 })),
        "another filter's count is its own"
    );
}
