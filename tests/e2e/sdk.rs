//! The Rust SDK's one-function form (`#[shallot_guest::around_chat]` on a
//! `fn`): a filter with no configuration type, loaded and run like any;
//! a token transform written as the SDK's `PassThrough`, which is left out;
//! and a wasm filter held by an embedder, which runs only in its own layer.

use serde_json::json;
use shallot::types::FinishReason;
use shallot::{Context, Kernel};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, load, spec};

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

#[tokio::test]
async fn a_token_transform_written_as_pass_through_is_never_opened() {
    let plugins = load(vec![
        spec("passthrough", "pass", json!(null)),
        spec("copy_tokens", "copy", json!(null)),
    ])
    .await;
    let (pass, copy) = (&plugins.filters()[0], &plugins.filters()[1]);
    use shallot::Hook::{AroundChat, AroundTool, AroundTurn, TokenTransform};
    assert_eq!(pass.hooks(), [AroundChat, AroundTool, AroundTurn]);
    assert_eq!(copy.hooks(), [TokenTransform]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![Reply::tokens(&[
            "a", "b", "c",
        ])]))
        .build()
        .unwrap();
    let sink = Collector::default();
    kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(sink.tokens(), ["a", "b", "c"]);
    // The pass-through's stream cost it no call; the copying transform
    // took every token.
    use shallot::Call::{Flush, Step, TokenTransform as Transformer};
    let called: Vec<_> = pass.stats().calls.iter().map(|c| c.call).collect();
    assert!(called.contains(&shallot::Call::AroundChat), "{called:?}");
    assert!(
        !called
            .iter()
            .any(|c| [Transformer, Step, Flush].contains(c)),
        "{called:?}"
    );
    assert_eq!((pass.stats().tokens_in, copy.stats().tokens_in), (0, 3));
}

/// Hands its own rest of the chain to a wasm filter's hook: an embedder's
/// native filter trying to run a sandboxed filter outside its layer.
struct Borrower(std::sync::Arc<shallot::WasmFilter>);

#[async_trait::async_trait]
impl shallot::Filter for Borrower {
    fn name(&self) -> &str {
        "borrower"
    }

    async fn around_chat(
        &self,
        request: shallot::types::ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, shallot::ChainError> {
        shallot::Filter::around_chat(&*self.0, request, next).await
    }
}

#[tokio::test]
async fn a_wasm_filters_hook_runs_only_in_its_own_layer() {
    let plugins = load(vec![spec("passthrough", "pass", json!(null))]).await;
    let model = ScriptedModel::answer("fine");
    let kernel = Kernel::builder()
        .filter(Borrower(plugins.filters()[0].clone()))
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let error = kernel.chat(ask("hello"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, shallot::ErrorKind::InvalidRequest, "{error}");
    assert!(error.message.contains("its own layer"), "{error}");
    assert_eq!(model.calls(), 0);
    // The filter in its own layer still runs.
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    assert_eq!(
        kernel
            .chat(ask("hello"), Context::new())
            .await
            .unwrap()
            .text(),
        "fine"
    );
}
