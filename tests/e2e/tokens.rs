//! The token transform chain (PEER-CASES F and G): order, 1 -> N, state per
//! stream, the flush cascade, no flush on error, delivery only.

use serde_json::json;
use shallot::types::{Message, TurnRequest, TurnResult};
use shallot::{ChainError, Context, ErrorKind, InvokeOptions, Kernel};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, load, spec, stream};

fn transform(name: &str, config: serde_json::Value) -> (std::path::PathBuf, shallot::FilterSpec) {
    let mut config = config;
    config["hooks"] = json!(["tokens"]);
    spec("probe", name, config)
}

// PEER-CASES F1
#[tokio::test]
async fn no_transforms_passes_tokens_straight_through() {
    let (result, sink) = stream(vec![], Reply::tokens(&["a", "b"])).await;
    assert_eq!(sink.tokens(), ["a", "b"]);
    assert_eq!(result.unwrap(), "ab");
}

// PEER-CASES F2
#[tokio::test]
async fn a_transform_emits_n_for_one_and_flushes_the_rest_at_the_end() {
    let tokens = ["1", "2", "3", "4", "5", "6", "7"];
    let (_, sink) = stream(
        vec![transform("batch", json!({ "batch": 3 }))],
        Reply::tokens(&tokens),
    )
    .await;
    assert_eq!(
        sink.deliveries(),
        [vec!["123", "456"], vec!["7"]],
        "the flush comes after the stream, as its own delivery"
    );
}

// PEER-CASES F3
#[tokio::test]
async fn a_failed_stream_is_not_flushed_so_buffered_tokens_never_leak() {
    let broken = Reply::BreakAfter(
        vec!["1".into(), "2".into()],
        ChainError::new(ErrorKind::Transient, "connection closed"),
    );
    let (result, sink) = stream(vec![transform("batch", json!({ "batch": 3 }))], broken).await;
    assert_eq!(result.unwrap_err().message, "connection closed");
    assert!(sink.tokens().is_empty());
}

// PEER-CASES F4
#[tokio::test]
async fn the_first_filter_sees_the_raw_token_first() {
    let filters = vec![
        transform("a", json!({ "prefix": "A" })),
        transform("b", json!({ "prefix": "B" })),
    ];
    let (_, sink) = stream(filters, Reply::tokens(&["x"])).await;
    assert_eq!(sink.tokens(), ["BAx"]);
}

// PEER-CASES F6
#[tokio::test]
async fn metadata_survives_buffering() {
    let tokens = Reply::Tokens(vec![
        ("a".into(), Some(r#"{"k":1}"#.into())),
        ("b".into(), Some(r#"{"k":1}"#.into())),
    ]);
    let (_, sink) = stream(vec![transform("batch", json!({ "batch": 2 }))], tokens).await;
    assert_eq!(
        sink.tokens_with_meta(),
        [("ab".to_owned(), Some(r#"{"k":1}"#.to_owned()))]
    );
}

// PEER-CASES F7
#[tokio::test]
async fn a_transform_can_swallow_a_token() {
    let (result, sink) = stream(
        vec![transform("drop", json!({ "drop": "secret" }))],
        Reply::tokens(&["a", "secret", "b"]),
    )
    .await;
    assert_eq!(sink.tokens(), ["a", "b"]);
    assert_eq!(
        result.unwrap(),
        "asecretb",
        "the answer itself keeps the swallowed token"
    );
}

#[tokio::test]
async fn flush_cascades_outer_leftovers_through_inner_steps_before_the_inner_flush() {
    let filters = vec![
        transform("outer", json!({ "batch": 2 })),
        transform("inner", json!({ "prefix": "P" })),
    ];
    let (_, sink) = stream(filters, Reply::tokens(&["a", "b", "c"])).await;
    assert_eq!(sink.tokens(), ["Pab", "Pc"]);

    let filters = vec![
        transform("outer", json!({ "batch": 2 })),
        transform("inner", json!({ "batch": 2 })),
    ];
    let (_, sink) = stream(filters, Reply::tokens(&["a", "b", "c"])).await;
    assert_eq!(
        sink.tokens(),
        ["abc"],
        "the inner layer buffered 'ab', then got 'c' from the outer flush"
    );
}

// PEER-CASES G6
#[tokio::test]
async fn a_chat_only_filter_leaves_the_stream_alone() {
    let (_, sink) = stream(
        vec![spec("probe", "chat", json!({ "hooks": ["chat"] }))],
        Reply::tokens(&["a", "b"]),
    )
    .await;
    assert_eq!(sink.tokens(), ["a", "b"]);
}

// PEER-CASES G7
#[tokio::test]
async fn the_non_streaming_path_ignores_token_transforms() {
    let plugins = load(vec![spec(
        "misbehave",
        "trapper",
        json!({ "on": "step", "do": "trap" }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .build()
        .unwrap();
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "fine"
    );
}

#[tokio::test]
async fn every_model_stream_gets_fresh_transform_state() {
    // A chat filter that calls next twice makes two streams: each flushes its own leftovers.
    let retry = spec("probe", "twice", json!({ "calls": 2, "hooks": ["chat"] }));
    let filters = vec![retry, transform("batch", json!({ "batch": 2 }))];
    let (_, sink) = stream(filters, Reply::tokens(&["a", "b", "c"])).await;
    assert_eq!(
        sink.deliveries(),
        [vec!["ab"], vec!["c"], vec!["ab"], vec!["c"]]
    );
}

#[tokio::test]
async fn a_sink_in_the_invoke_options_streams_any_entry_point() {
    let plugins = load(vec![transform("a", json!({ "prefix": "A" }))]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![
            Reply::tokens(&["x", "y"]),
            Reply::tokens(&["z"]),
        ]))
        .build()
        .unwrap();
    let sink = Collector::default();
    let options = InvokeOptions::from(Context::new()).stream_to(sink.clone());
    let response = kernel.chat(ask("hi"), options.clone()).await.unwrap();
    assert_eq!(response.text(), "xy", "the result keeps the model's text");
    let turn = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), options)
        .await;
    assert!(matches!(turn, TurnResult::Done(_)), "{turn:?}");
    assert_eq!(sink.tokens(), ["Ax", "Ay", "Az"]);
}
