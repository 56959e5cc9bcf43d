//! The Rust SDK's one-function form (`#[shallot_guest::around_chat]` on a
//! `fn`): a filter with no configuration type, loaded and run like any.

use serde_json::json;
use shallot::types::FinishReason;
use shallot::{Context, Kernel};
use shallot_tests::{ScriptedModel, ask, load, spec};

#[tokio::test]
async fn a_filter_written_as_one_function_runs_its_hook_and_ignores_any_configuration() {
    let plugins = load(vec![spec(
        "one_function",
        "one-function",
        json!({"whatever": [1, 2]}),
    )])
    .await;
    let filter = &plugins.filters()[0];
    assert_eq!(filter.hooks(), [shallot::Hook::AroundChat]);
    let model = ScriptedModel::answer("fine");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let passed = kernel.chat(ask("hello"), Context::new()).await.unwrap();
    assert_eq!(passed.text(), "checked: fine");
    let blocked = kernel
        .chat(ask("the secret"), Context::new())
        .await
        .unwrap();
    assert_eq!(blocked.text(), "blocked");
    assert_eq!(blocked.finish_reason, FinishReason::ContentFiltered);
    assert_eq!(model.calls(), 1);
}
