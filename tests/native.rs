//! The onion's semantics with native filters only: composition order,
//! short-circuit and retry, FCtx kept per filter and folded by call index
//! after a concurrent batch, and the token transform cascade. No `.wasm`
//! is loaded, so these run before (and without) the guests being built.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{Value, json};
use shallot::types::{
    ChatRequest, ChatResponse, FinishReason, Message, TokenBatch, ToolRequest, ToolResponse,
    ToolSpec, TurnRequest, TurnResult,
};
use shallot::{
    ChainError, Chat, Context, ErrorKind, Fctx, Filter, FilterScope, Hook, Kernel, Next,
    TokenTransform, Tool,
};
use shallot_tests::{Collector, Reply, ScriptedModel, ask};

/// What the filters of a test did, in order.
type Log = Arc<Mutex<Vec<String>>>;

fn logged(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// Logs "<name> before" and "<name> after" around the chat chain.
struct Around {
    name: &'static str,
    log: Log,
}

#[async_trait]
impl Filter for Around {
    fn name(&self) -> &str {
        self.name
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} before", self.name));
        let response = next.call(request).await;
        self.log
            .lock()
            .unwrap()
            .push(format!("{} after", self.name));
        response
    }
}

/// Joins only the tool chain, logging if it is ever entered for a chat.
struct ToolsOnly(Log);

#[async_trait]
impl Filter for ToolsOnly {
    fn name(&self) -> &str {
        "tools-only"
    }

    fn hooks(&self) -> &[Hook] {
        &[Hook::AroundTool]
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        self.0.lock().unwrap().push("tools-only entered".into());
        next.call(request).await
    }
}

#[tokio::test]
async fn layers_nest_in_list_order_and_a_filter_without_the_hook_is_not_in_the_chain() {
    let log = Log::default();
    let kernel = Kernel::builder()
        .filter(Around {
            name: "outer",
            log: log.clone(),
        })
        .filter(ToolsOnly(log.clone()))
        .filter(Around {
            name: "inner",
            log: log.clone(),
        })
        .model(ScriptedModel::answer("hi"))
        .build()
        .unwrap();
    let response = kernel.chat(ask("q"), Context::new()).await.unwrap();
    assert_eq!(response.text(), "hi");
    assert_eq!(
        logged(&log),
        ["outer before", "inner before", "inner after", "outer after"]
    );
}

/// Answers without the model when asked "cached"; otherwise calls the
/// inner layers `tries` times and returns the last answer.
struct Cache {
    tries: usize,
}

#[async_trait]
impl Filter for Cache {
    fn name(&self) -> &str {
        "cache"
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        if request.messages.last().map(Message::text).as_deref() == Some("cached") {
            let message = Message::assistant("from the cache");
            return Ok(ChatResponse::new(message, FinishReason::Complete));
        }
        let mut last = next.call(request.clone()).await;
        for _ in 1..self.tries {
            last = next.call(request.clone()).await;
        }
        last
    }
}

#[tokio::test]
async fn a_layer_may_answer_without_the_inner_layers_or_call_them_again() {
    let model = ScriptedModel::new(|n, _| Reply::Text(format!("answer {n}")));
    let kernel = Kernel::builder()
        .filter(Cache { tries: 2 })
        .model(model.clone())
        .build()
        .unwrap();
    let cached = kernel.chat(ask("cached"), Context::new()).await.unwrap();
    assert_eq!(cached.text(), "from the cache");
    assert_eq!(model.calls(), 0);
    let retried = kernel.chat(ask("q"), Context::new()).await.unwrap();
    assert_eq!(retried.text(), "answer 2");
    assert_eq!(model.calls(), 2);
}

/// Counts its around-chat calls in its FCtx and logs each count, with
/// what `peer`'s FCtx looks like to it (its own, never the peer's).
struct Counter {
    name: &'static str,
    log: Log,
}

#[async_trait]
impl Filter for Counter {
    fn name(&self) -> &str {
        self.name
    }

    fn init_fctx(&self) -> Fctx {
        Fctx::from(r#"{"calls":0}"#)
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        let fctx: Value = serde_json::from_str(&next.fctx().unwrap()).unwrap();
        let calls = fctx["calls"].as_u64().unwrap() + 1;
        next.set_fctx(json!({ "calls": calls }).to_string());
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {calls}", self.name));
        next.call(request).await
    }
}

fn echo_tool() -> ToolSpec {
    ToolSpec::new("echo", "echoes", json!({"type": "object"}))
}

#[tokio::test]
async fn a_filters_fctx_is_its_own_kept_across_the_rounds_of_a_turn_and_fresh_per_invoke() {
    let log = Log::default();
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({})),
        Reply::Text("done".into()),
        Reply::Text("again".into()),
    ]);
    let kernel = Kernel::builder()
        .filter(Counter {
            name: "a",
            log: log.clone(),
        })
        .filter(Counter {
            name: "b",
            log: log.clone(),
        })
        .tool(echo_tool(), |args, _| async move { Ok(args) })
        .model(model)
        .build()
        .unwrap();
    let turn = TurnRequest::new(vec![Message::user("go")]);
    let result = kernel.turn(turn.clone(), Context::new()).await;
    assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
    assert_eq!(logged(&log), ["a 1", "b 1", "a 2", "b 2"]);
    kernel.turn(turn, Context::new()).await;
    assert_eq!(logged(&log)[4..], ["a 1", "b 1"]);
}

/// Writes the call's id into its FCtx in each around-tool, and logs what
/// its FCtx holds when the next model call comes.
struct LastCall(Log);

#[async_trait]
impl Filter for LastCall {
    fn name(&self) -> &str {
        "last-call"
    }

    async fn around_tool(
        &self,
        request: ToolRequest,
        next: Next<Tool>,
    ) -> Result<ToolResponse, ChainError> {
        let seen = next.fctx().unwrap();
        next.set_fctx(json!({ "call": &*request.call_id, "saw": &*seen }).to_string());
        next.call(request).await
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        self.0
            .lock()
            .unwrap()
            .push(next.fctx().unwrap().to_string());
        next.call(request).await
    }
}

#[tokio::test]
async fn the_fctx_writes_of_a_concurrent_batch_fold_by_call_index_each_call_seeing_the_start() {
    let log = Log::default();
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("echo".into(), json!({"n": 1})),
            ("echo".into(), json!({"n": 2})),
            ("echo".into(), json!({"n": 3})),
        ]),
        Reply::Text("done".into()),
    ]);
    let kernel = Kernel::builder()
        .filter(LastCall(log.clone()))
        .tool(echo_tool(), |args, _| async move { Ok(args) })
        .model(model)
        .build()
        .unwrap();
    let turn = TurnRequest::new(vec![Message::user("go")]);
    kernel.turn(turn, Context::new()).await;
    let seen = logged(&log);
    assert_eq!(seen[0], "{}");
    let after: Value = serde_json::from_str(&seen[1]).unwrap();
    // The last call by index wins, and every call saw the state from
    // before the batch, not a sibling's write.
    assert!(after["call"].as_str().unwrap().ends_with("-2"), "{after}");
    assert_eq!(after["saw"], "{}");
}

/// Holds every token until the stream ends, then gives them all.
struct HoldAll;

#[async_trait]
impl TokenTransform for HoldAll {
    async fn step(&mut self, _: TokenBatch) -> Result<TokenBatch, ChainError> {
        Ok(TokenBatch::default())
    }

    async fn flush(&mut self, _: FinishReason) -> Result<TokenBatch, ChainError> {
        let mut held = TokenBatch::default();
        held.push("held", None);
        Ok(held)
    }
}

/// Upper-cases every token it is given.
struct Upper;

#[async_trait]
impl TokenTransform for Upper {
    async fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError> {
        let mut upper = TokenBatch::default();
        for token in tokens.iter() {
            upper.push(&token.text.to_uppercase(), token.meta);
        }
        Ok(upper)
    }
}

/// A filter whose only hook is a token transform made by `make`.
struct Transforms(&'static str, fn() -> Box<dyn TokenTransform>);

#[async_trait]
impl Filter for Transforms {
    fn name(&self) -> &str {
        self.0
    }

    fn hooks(&self) -> &[Hook] {
        &[Hook::TokenTransform]
    }

    async fn token_transform(
        &self,
        _: &FilterScope,
    ) -> Result<Option<Box<dyn TokenTransform>>, ChainError> {
        Ok(Some((self.1)()))
    }
}

fn holding_then_upper(model: ScriptedModel) -> Kernel {
    Kernel::builder()
        .filter(Transforms("hold", || Box::new(HoldAll)))
        .filter(Transforms("upper", || Box::new(Upper)))
        .model(model)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_flush_goes_through_the_later_transforms_and_the_answer_stays_the_models() {
    let kernel = holding_then_upper(ScriptedModel::replies(vec![Reply::tokens(&["a", "b"])]));
    let sink = Collector::default();
    let response = kernel
        .chat_stream(ask("q"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(sink.tokens(), ["HELD"]);
    assert_eq!(response.text(), "ab");
}

#[tokio::test]
async fn a_stream_that_fails_flushes_nothing() {
    let broken = ChainError::new(ErrorKind::Transient, "connection reset");
    let model = ScriptedModel::replies(vec![Reply::BreakAfter(vec!["a".into()], broken)]);
    let kernel = holding_then_upper(model);
    let sink = Collector::default();
    let error = kernel
        .chat_stream(ask("q"), Context::new(), sink.clone())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient);
    assert!(sink.tokens().is_empty(), "{:?}", sink.tokens());
}
