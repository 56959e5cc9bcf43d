//! What a filter's side calls spend, the grant sees: a side call is a
//! request the host builds (an allow-list of options: no `n`, no
//! `stream`, no option it does not know, `max_completion_tokens` capped
//! as `max_tokens` is), its prompt charged before it leaves, each attempt
//! (a retry, another upstream of a pool) reserving its worst case from
//! the same grant and settled at what it cost; and a request's whole tree
//! of calls to models, across every gateway a loop leads it back
//! through, spends one budget that the first request carries.

use serde_json::{Value, json};
use shallot::{
    ChainError, Context, ErrorKind, Gateway, GatewayConfig, Kernel, ModelGrant, OpenAiConfig,
    OpenAiModel, PoolConfig, Route, UpstreamPool,
};
use shallot_tests::{Canned, FakeProvider, ask, load, spec};
use tokio::net::TcpListener;

use crate::gateway::{Served, config};

/// An answer of `text` that says it spent `prompt` and `completion`
/// tokens.
fn billed(text: &str, prompt: u64, completion: u64) -> Canned {
    Canned::Json(
        200,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
            "usage": { "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion }
        }),
        vec![],
    )
}

fn server(provider: &FakeProvider, max_retries: u32) -> OpenAiModel {
    let config = OpenAiConfig {
        max_retries,
        ..OpenAiConfig::new(&provider.url, "m")
    };
    OpenAiModel::new(config).unwrap()
}

/// A kernel over `model` whose one filter (misbehave) makes side calls to
/// it as `action` says, granted `tokens`.
async fn side_calling(model: impl shallot::ChatModel, action: Value, tokens: u32) -> Kernel {
    let mut config = json!({ "on": "chat", "when": "side" });
    config
        .as_object_mut()
        .unwrap()
        .extend(action.as_object().unwrap().clone());
    let (path, mut filter) = spec("misbehave", "sider", config);
    filter.grants.model = Some(ModelGrant {
        tokens,
        ..ModelGrant::of("default")
    });
    let plugins = load(vec![(path, filter)]).await;
    Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap()
}

async fn chat(kernel: &Kernel) -> Result<String, ChainError> {
    Ok(kernel.chat(ask("side"), Context::new()).await?.text())
}

#[tokio::test]
async fn a_side_call_carries_only_options_that_shape_its_answer_within_the_grant() {
    let provider = FakeProvider::start(vec![billed("fine", 10, 20)]).await;
    let asks_more = json!({ "do": "side-call", "options": { "max_completion_tokens": 100_000, "temperature": 0.2 } });
    let kernel = side_calling(server(&provider, 0), asks_more, 8192).await;
    chat(&kernel).await.unwrap();
    let sent = &provider.bodies()[0];
    assert!(
        sent["max_tokens"].as_u64().unwrap() < 8192,
        "capped to what the grant has left after the prompt: {sent}"
    );
    assert_eq!(sent["temperature"], 0.2, "{sent}");
    assert!(sent.get("max_completion_tokens").is_none(), "{sent}");

    for (options, says) in [
        (json!({ "n": 16 }), "`n` must be 1"),
        (json!({ "stream": true }), "never streamed"),
        (json!({ "service_tier": "priority" }), "service_tier"),
        (
            json!({ "model": "the-expensive-one" }),
            "unknown field `model`",
        ),
        (
            json!({ "stop": ["a", "b", "c", "d", "e"] }),
            "no more than 4",
        ),
        (json!({ "user": "someone-else" }), "unknown field `user`"),
        (json!({ "temperature": "hot" }), "not model options"),
    ] {
        let action = json!({ "do": "side-call", "options": options });
        let kernel = side_calling(server(&provider, 0), action, 8192).await;
        let error = chat(&kernel).await.unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidRequest, "{options}: {error}");
        assert!(error.message.contains(says), "{options}: {error}");
    }
    let megabyte = json!({ "do": "side-call", "prompt_bytes": 1 << 20 });
    let kernel = side_calling(server(&provider, 0), megabyte, 8192).await;
    let error = chat(&kernel).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("does not fit"), "{error}");
    assert_eq!(
        provider.bodies().len(),
        2,
        "the first chat's side call and its own model call; nothing refused left the host"
    );
}

/// Each attempt of a side call, a retry or the next upstream of a pool,
/// reserves the call's worst case from one grant and is settled at what
/// it cost: three failing upstreams with two retries each got 9 attempts
/// whatever the grant; now each failure costs its prompt, and after the
/// third the grant cannot reserve a fourth.
#[tokio::test]
async fn retries_and_failover_of_a_side_call_spend_from_one_grant() {
    let failing = || async {
        FakeProvider::start(vec![Canned::Json(
            500,
            json!({ "error": { "message": "overloaded" } }),
            vec![],
        )])
        .await
    };
    let providers = [failing().await, failing().await, failing().await];
    let mut pool = UpstreamPool::new(PoolConfig::default());
    for (n, provider) in providers.iter().enumerate() {
        pool = pool.upstream(format!("u{n}"), 1, server(provider, 2));
    }
    // A prompt of about 2,000 tokens and an answer of at most 1,000: each
    // attempt reserves about 3,000 of 8,192 and a failure costs its
    // prompt: 8,192, 6,188, 4,184, 2,180 left before each.
    let action =
        json!({ "do": "side-call", "prompt_bytes": 8000, "options": { "max_tokens": 1000 } });
    let kernel = side_calling(pool, action, 8192).await;
    let error = chat(&kernel).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("another attempt"), "{error}");
    let sent: usize = providers.iter().map(|p| p.bodies().len()).sum();
    assert_eq!(sent, 3);
}

/// A side call's answer is charged what the model says it spent, past its
/// reservation too: what is left caps the next call's `max_tokens`.
#[tokio::test]
async fn a_side_call_is_charged_what_the_model_reports() {
    let provider = FakeProvider::start(vec![billed("long", 5000, 3000)]).await;
    let kernel = side_calling(server(&provider, 0), json!({ "do": "model-flood" }), 8192).await;
    let error = chat(&kernel).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    let bodies = provider.bodies();
    assert_eq!(bodies.len(), 2, "8,000 of 8,192 spent by the first");
    let prompt = 6;
    assert_eq!(
        bodies[1]["max_tokens"],
        8192 - 8000 - prompt,
        "{}",
        bodies[1]
    );
}

/// A route whose model is the gateway itself, with a filter that makes
/// its four side calls a hook call back into it: each request fanned out
/// five-fold until the hop limit (87,381 gateway requests for one
/// client's); now the whole tree sends no more than the first request's
/// budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_of_side_calls_through_the_gateway_ends_at_the_first_requests_budget() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let itself = OpenAiModel::new(OpenAiConfig {
        max_retries: 0,
        ..OpenAiConfig::new(format!("{base}/v1"), "looped")
    })
    .unwrap();
    let (path, mut fan) = spec(
        "misbehave",
        "fan",
        json!({ "on": "chat", "do": "side-fan" }),
    );
    fan.grants.model = Some(ModelGrant::of("default"));
    let plugins = load(vec![(path, fan)]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(itself)
        .build()
        .unwrap();
    let config = GatewayConfig {
        max_model_requests: 64,
        ..config()
    };
    let gateway = Gateway::new(vec![Route::proxy("looped", kernel)], config);
    let served = Served::listening(gateway, listener).await;
    let (status, body) = served
        .complete(json!({ "model": "looped", "messages": [{ "role": "user", "content": "go" }] }))
        .await;
    assert!(status >= 400, "a loop ends in an error: {status} {body}");
    let (_, metrics) = served.get("/metrics").await;
    let requests: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("shallot_gateway_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(
        (2..=65).contains(&requests),
        "one client request and at most 64 it caused, not {requests}"
    );
    served.stop().await.unwrap();
}
