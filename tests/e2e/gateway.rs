//! The OpenAI-compatible gateway (`shallot serve`) over HTTP on loopback:
//! JSON and streamed completions as OpenAI's clients read them, tool calls
//! both ways, the token transforms on every answer, errors by kind, and the
//! bounds (body cap, queue, deadline, drain).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::ChatRequest;
use shallot::{ChainError, ErrorKind, Gateway, GatewayConfig, Kernel, Route, RouteMode};
use shallot_tests::{Canned, FakeProvider, Reply, ScriptedModel, load, spec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A gateway serving on a free loopback port.
pub(crate) struct Served {
    pub(crate) base: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Served {
    pub(crate) async fn start(kernel: Kernel, config: GatewayConfig) -> Self {
        Self::gateway(Gateway::new(vec![Route::proxy("scripted", kernel)], config)).await
    }

    pub(crate) async fn gateway(gateway: Gateway) -> Self {
        Self::at(gateway, "127.0.0.1:0").await
    }

    /// The same, on `address`.
    pub(crate) async fn at(gateway: Gateway, address: &str) -> Self {
        let listener = TcpListener::bind(address).await.unwrap();
        Self::listening(gateway, listener).await
    }

    /// The same, on `listener` (bound before the gateway was built, so
    /// that a route can name the gateway's own address).
    pub(crate) async fn listening(gateway: Gateway, listener: TcpListener) -> Self {
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let task = tokio::spawn(async move { gateway.serve(listener, shutdown).await });
        Served {
            base,
            stop: Some(stop),
            task,
        }
    }

    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        let response = reqwest::get(format!("{}{path}", self.base)).await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    /// Posts a completion request; the status, the `Retry-After` header and
    /// the body.
    async fn post(&self, body: impl Into<reqwest::Body>) -> (u16, Option<String>, String) {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let retry = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        (
            response.status().as_u16(),
            retry,
            response.text().await.unwrap(),
        )
    }

    pub(crate) async fn complete(&self, request: Value) -> (u16, Value) {
        let (status, _, body) = self.post(request.to_string()).await;
        let body = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        (status, body)
    }

    /// A streamed completion: the status and each event's data.
    async fn stream(&self, mut request: Value) -> (u16, Vec<String>) {
        request["stream"] = json!(true);
        let (status, _, body) = self.post(request.to_string()).await;
        let events = body
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .map(str::to_owned)
            .collect();
        (status, events)
    }

    /// Posts `request` in the background; its answer when it comes.
    fn in_flight(&self, request: Value) -> JoinHandle<Value> {
        let url = format!("{}/v1/chat/completions", self.base);
        tokio::spawn(async move {
            let response = reqwest::Client::new().post(url).json(&request).send().await;
            response.unwrap().json::<Value>().await.unwrap()
        })
    }

    /// Waits until `/metrics` has the line `line`: what the gateway does
    /// with a request, seen from outside (at most a minute, then the test
    /// fails).
    pub(crate) async fn metric_reads(&self, line: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (_, metrics) = self.get("/metrics").await;
            if metrics.lines().any(|l| l == line) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "/metrics never read {line}: {metrics}"
            );
            tokio::task::yield_now().await;
        }
    }

    pub(crate) async fn stop(mut self) -> std::io::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap()
    }
}

pub(crate) fn config() -> GatewayConfig {
    GatewayConfig::default()
}

fn ask(text: &str) -> Value {
    json!({ "model": "scripted", "messages": [{ "role": "user", "content": text }] })
}

/// A question for the route of `model`.
fn ask_model(model: &str) -> Value {
    json!({ "model": model, "messages": [{ "role": "user", "content": "key?" }] })
}

pub(crate) async fn kernel(
    filters: Vec<(std::path::PathBuf, shallot::FilterSpec)>,
    model: ScriptedModel,
) -> Kernel {
    let plugins = load(filters).await;
    Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap()
}

/// The content deltas of a stream, joined.
fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

fn chunks(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .collect()
}

#[tokio::test]
async fn a_completion_answers_as_openai_does_and_the_service_endpoints_answer() {
    let kernel = kernel(
        vec![spec("passthrough", "pass", json!(null))],
        ScriptedModel::answer("hello"),
    )
    .await;
    let served = Served::start(kernel, config()).await;
    let (status, body) = served.complete(ask("hi")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "scripted");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(
        choice["message"],
        json!({ "role": "assistant", "content": "hello" })
    );
    assert_eq!(choice["finish_reason"], "stop");
    assert!(body["usage"]["total_tokens"].is_u64(), "{body}");

    let (status, models) = served.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "scripted");
    assert_eq!(served.get("/healthz").await.0, 200);
    let (status, ready) = served.get("/readyz").await;
    assert_eq!(status, 200);
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["routes"][0]["filters"][0]["name"], "pass");
    assert_eq!(ready["routes"][0]["mode"], "proxy");
    let (status, missing) = served.get("/v1/nothing").await;
    assert_eq!(status, 404, "{missing}");
    served.stop().await.unwrap();
}

/// An upstream's tool call without arguments (some servers omit them for
/// a tool that takes none) reaches the client as `{}`, which its SDK can
/// parse, not as an empty string.
#[tokio::test]
async fn a_tool_call_without_arguments_reaches_the_client_as_an_empty_object() {
    let provider = FakeProvider::start(vec![Canned::Json(
        200,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [{ "id": "call_1", "type": "function", "function": { "name": "now" } }] } }]
        }),
        vec![],
    )])
    .await;
    let model = shallot::OpenAiModel::new(shallot::OpenAiConfig::new(&provider.url, "m")).unwrap();
    let kernel = Kernel::builder().model(model).build().unwrap();
    let served = Served::start(kernel, config()).await;
    let mut request = ask("what time is it?");
    request["tools"] = json!([{ "type": "function", "function": { "name": "now", "parameters": { "type": "object" } } }]);
    let (status, body) = served.complete(request).await;
    assert_eq!(status, 200, "{body}");
    let call = &body["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "now");
    assert_eq!(call["function"]["arguments"], "{}");
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_streamed_completion_sends_chunks_the_finish_the_usage_then_done() {
    let model = ScriptedModel::replies(vec![Reply::Paced(
        vec!["hel".into(), "lo".into()],
        Duration::from_millis(5),
    )]);
    let served = Served::start(kernel(vec![], model).await, config()).await;
    let mut request = ask("hi");
    request["stream_options"] = json!({ "include_usage": true });
    let (status, events) = served.stream(request).await;
    assert_eq!(status, 200, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&events);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"),
        "{chunks:?}"
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(streamed_text(&events), "hello");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["prompt_tokens"].is_u64(), "{usage}");

    let mut request = ask("hi");
    request["stream_options"] = json!({ "include_usage": null });
    let (status, events) = served.stream(request).await;
    assert_eq!(status, 200, "a null is not asking: {events:?}");
    assert!(
        self::chunks(&events).iter().all(|c| c["usage"].is_null()),
        "{events:?}"
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn tool_calls_go_to_the_model_and_come_back_to_the_client_both_ways() {
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        match request.messages.last().map(|m| m.role) {
            Some(shallot::types::Role::Tool) => Reply::Text(format!(
                "sum is {}",
                request.messages.last().unwrap().text()
            )),
            _ => Reply::call("add", json!({ "a": 1, "b": 2 })),
        }
    });
    let served = Served::start(kernel(vec![], model.clone()).await, config()).await;
    let tools = json!([{ "type": "function", "function": {
        "name": "add", "description": "adds", "parameters": { "type": "object" }, "strict": true } }]);
    let mut request = ask("add 1 and 2");
    request["tools"] = tools.clone();
    request["tool_choice"] = json!("auto");
    request["user"] = json!("user-7");
    let (status, body) = served.complete(request.clone()).await;
    assert_eq!(status, 200, "{body}");
    let message = &body["choices"][0]["message"];
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(message["content"], Value::Null);
    let call = &message["tool_calls"][0];
    assert_eq!(call["function"]["name"], "add");
    assert_eq!(call["type"], "function");
    let seen = &model.requests()[0];
    assert_eq!(
        seen.tools[0].name, "add",
        "the client's tools reach the model"
    );
    assert!(seen.tools[0].strict, "strict as the client asked");
    assert_eq!(
        seen.options.tool_choice,
        Some(shallot::types::ToolChoice::Auto),
        "and so do its options"
    );
    assert_eq!(
        seen.options.user.as_deref(),
        Some("user-7"),
        "and its end user's id"
    );

    // The client runs the tool and sends the result back.
    let mut messages = request["messages"].as_array().unwrap().clone();
    messages.push(message.clone());
    messages.push(json!({ "role": "tool", "tool_call_id": call["id"], "content": "3" }));
    request["messages"] = Value::Array(messages);
    let (status, body) = served.complete(request.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "sum is 3");

    let (status, events) = served.stream(json!({ "model": "scripted", "messages": [{ "role": "user", "content": "again" }], "tools": tools })).await;
    assert_eq!(status, 200);
    let chunks = chunks(&events);
    let streamed = chunks
        .iter()
        .find(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
        .expect("a tool-calls chunk");
    assert_eq!(
        streamed["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "add"
    );
    assert_eq!(streamed["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "tool_calls")
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_redaction_filter_holds_on_the_json_answer_and_on_the_stream() {
    let redact = spec(
        "token_redact",
        "redact",
        json!({ "pattern": "sk-[A-Za-z0-9]+", "replacement": "[KEY]", "window": 48 }),
    );
    let model = ScriptedModel::new(|_, _: &ChatRequest| {
        Reply::Paced(
            vec![
                "your key: sk-li".into(),
                "ve4f9a".into(),
                "2b7c, keep it".into(),
            ],
            Duration::from_millis(2),
        )
    });
    let served = Served::start(kernel(vec![redact], model).await, config()).await;
    let (status, _, body) = served.post(ask("my key?").to_string()).await;
    assert_eq!(status, 200);
    assert!(!body.contains("sk-live"), "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "your key: [KEY], keep it"
    );
    let (status, events) = served.stream(ask("my key?")).await;
    assert_eq!(status, 200);
    assert!(!events.concat().contains("sk-live"), "{events:?}");
    assert_eq!(streamed_text(&events), "your key: [KEY], keep it");
    served.stop().await.unwrap();
}

/// `moderation` granted a local service that speaks OpenAI's moderation
/// wire: a flagged question is answered by the filter (the model is never
/// asked), and a flagged answer is withheld from the window it is found in,
/// in the JSON answer and in the stream alike, the flagged text never
/// reaching the client; an innocent answer comes through whole.
#[tokio::test]
async fn moderation_blocks_a_flagged_question_and_withholds_a_flagged_answer_in_json_and_in_the_stream()
 {
    let service = shallot_tests::WebService::start().await;
    let (path, mut moderation) = spec(
        "moderation",
        "moderation",
        json!({ "url": service.url("/moderate"), "window": 16, "failure_response": "Not that." }),
    );
    moderation.grants.http = Some(shallot_tests::http_grant(&[&service.origin()]));
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        if request.messages.last().unwrap().text().contains("plans") {
            let pieces = ["We meet at noon. ", "Then we att", "ack the fort."];
            Reply::Paced(pieces.map(str::to_owned).to_vec(), Duration::from_millis(2))
        } else {
            Reply::Text("All quiet here.".into())
        }
    });
    let served = Served::start(
        kernel(vec![(path, moderation)], model.clone()).await,
        config(),
    )
    .await;
    let (status, body) = served.complete(ask("how do I attack a fort?")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(body["choices"][0]["message"]["content"], "Not that.");
    let (_, events) = served.stream(ask("how do I attack a fort?")).await;
    assert_eq!(streamed_text(&events), "Not that.");
    assert_eq!(
        model.calls(),
        0,
        "a flagged question never reaches the model"
    );

    let (status, body) = served.complete(ask("your plans?")).await;
    assert_eq!(status, 200, "{body}");
    let withheld = "[withheld by moderation]";
    assert_eq!(
        body["choices"][0]["message"]["content"], withheld,
        "one answer, one window"
    );
    let (_, events) = served.stream(ask("your plans?")).await;
    assert!(!events.concat().contains("att"), "{events:?}");
    let text = streamed_text(&events);
    let released = format!("We meet at noon. {withheld}");
    assert!(
        text == released || text == withheld,
        "a window that passed is released, the flagged one withheld (as the batches fall): {text}"
    );

    let (_, body) = served.complete(ask("news?")).await;
    assert_eq!(body["choices"][0]["message"]["content"], "All quiet here.");
    let (_, events) = served.stream(ask("news?")).await;
    assert_eq!(streamed_text(&events), "All quiet here.");
    let (_, metrics) = served.get("/metrics").await;
    let flagged = r#"shallot_gateway_plugin_moderation__checks_total{filter="moderation",outcome="flagged",role="user"} 2"#;
    assert!(
        metrics.contains(flagged),
        "the filter's own metric: {metrics}"
    );
    served.stop().await.unwrap();
}

/// A filter that floods its metrics: a thousand series of one counter
/// (kept to 64, the rest counted as `other`), label values that would
/// forge exposition lines (escaped), and metrics past 32 (refused, its own
/// `invalid-request`); `/metrics` stays small and says only the truth.
#[tokio::test]
async fn a_filter_that_floods_its_metrics_cannot_blow_up_or_forge_the_exposition() {
    let mut bad = spec(
        "misbehave",
        "flood",
        json!({ "on": "chat", "do": "metrics-flood" }),
    );
    // A thousand host calls: time enough that the flood, not the clock,
    // decides what happens.
    bad.1.limits = shallot::Limits {
        cpu_ms: 10_000,
        wall_ms: 20_000,
        ..shallot::Limits::default()
    };
    let served = Served::start(
        kernel(vec![bad], ScriptedModel::answer("fine")).await,
        config(),
    )
    .await;
    let (status, body) = served.complete(ask("go")).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 32 metrics"),
        "{body}"
    );
    let (_, metrics) = served.get("/metrics").await;
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("shallot_gateway_forged")),
        "{metrics}"
    );
    let floods: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("shallot_gateway_plugin_flood__floods_total"))
        .collect();
    assert_eq!(floods.len(), 64, "{floods:?}");
    assert!(
        floods.contains(
            &r#"shallot_gateway_plugin_flood__floods_total{filter="flood",n="other"} 937"#
        ),
        "{floods:?}"
    );
    let declared = metrics
        .lines()
        .filter(|l| l.starts_with("# TYPE shallot_gateway_plugin_flood__"))
        .count();
    assert_eq!(declared, 32);
    served.stop().await.unwrap();
}

/// Metrics the exposition's reader would refuse: a label named `le` is
/// refused to the filter (a sample with `le` twice made Prometheus refuse
/// the whole scrape), and two filters whose names and metrics run
/// together alike (`hostile` + `audit_blocked`, `hostile-audit` +
/// `blocked`) keep a family each instead of one being dropped.
#[tokio::test]
async fn a_filters_metrics_cannot_break_the_exposition_or_share_another_filters_family() {
    let counting = |name: &str, metric: &str| {
        spec(
            "misbehave",
            name,
            json!({ "on": "chat", "do": "count", "metric": metric }),
        )
    };
    let filters = vec![
        counting("hostile", "audit_blocked"),
        counting("hostile-audit", "blocked"),
    ];
    let served = Served::start(
        kernel(filters, ScriptedModel::answer("fine")).await,
        config(),
    )
    .await;
    let (status, body) = served.complete(ask("go")).await;
    assert_eq!(status, 200, "{body}");
    let (_, metrics) = served.get("/metrics").await;
    for line in [
        r#"shallot_gateway_plugin_hostile__audit_blocked_total{filter="hostile"} 1"#,
        r#"shallot_gateway_plugin_hostile_audit__blocked_total{filter="hostile-audit"} 1"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line}\n{metrics}");
    }
    served.stop().await.unwrap();

    let le = spec(
        "misbehave",
        "buckets",
        json!({ "on": "chat", "do": "metric-le" }),
    );
    let served = Served::start(
        kernel(vec![le], ScriptedModel::answer("fine")).await,
        config(),
    )
    .await;
    let (status, body) = served.complete(ask("go")).await;
    assert_eq!(status, 400, "{body}");
    let said = body["error"]["message"].as_str().unwrap();
    assert!(said.contains("the label `le`"), "{body}");
    let (_, metrics) = served.get("/metrics").await;
    assert!(!metrics.contains("plugin_buckets"), "{metrics}");
    served.stop().await.unwrap();
}

/// The webhook wire, and a service that fails: with `fail = "closed"`
/// (the default) nothing passes unchecked, with `fail = "open"` everything
/// passes; `action = "flag"` lets a flagged question through, marked.
#[tokio::test]
async fn moderation_over_a_webhook_fails_closed_or_open_and_can_flag_instead_of_block() {
    let service = shallot_tests::WebService::start().await;
    let gone = format!("http://127.0.0.1:{}", service.address.port() + 1);
    let served = |settings: Value, origin: String| async move {
        let (path, mut moderation) = spec("moderation", "moderation", settings);
        moderation.grants.http = Some(shallot_tests::http_grant(&[&origin]));
        let model = ScriptedModel::answer("Fine.");
        Served::start(kernel(vec![(path, moderation)], model).await, config()).await
    };
    let webhook = json!({ "url": service.url("/webhook"), "wire": "webhook", "action": "flag" });
    let flagging = served(webhook, service.origin()).await;
    let (_, body) = flagging.complete(ask("an attack")).await;
    assert_eq!(body["choices"][0]["message"]["content"], "Fine.");
    flagging.stop().await.unwrap();
    let webhook = json!({ "url": service.url("/webhook"), "wire": "webhook" });
    let blocking = served(webhook, service.origin()).await;
    let (_, body) = blocking.complete(ask("an attack")).await;
    assert_eq!(body["choices"][0]["finish_reason"], "content_filter");
    let (_, body) = blocking.complete(ask("a picnic")).await;
    assert_eq!(body["choices"][0]["message"]["content"], "Fine.");
    blocking.stop().await.unwrap();

    let closed = served(
        json!({ "url": format!("{gone}/v1/moderations") }),
        gone.clone(),
    )
    .await;
    let (_, body) = closed.complete(ask("a picnic")).await;
    assert_eq!(body["choices"][0]["finish_reason"], "content_filter");
    let (_, events) = closed.stream(ask("a picnic")).await;
    assert!(!events.concat().contains("Fine."), "{events:?}");
    closed.stop().await.unwrap();
    let open = served(
        json!({ "url": format!("{gone}/v1/moderations"), "fail": "open" }),
        gone,
    )
    .await;
    let (_, body) = open.complete(ask("a picnic")).await;
    assert_eq!(body["choices"][0]["message"]["content"], "Fine.");
    open.stop().await.unwrap();
}

/// `POST /v1/embeddings` reaches the route's model through no filter: the
/// embedded model's vectors (the same text, the same vector), an
/// OpenAI-compatible upstream asked for its own model, a model without
/// embeddings a `404`, bad input a `400`; counted in `/metrics`.
#[tokio::test]
async fn embeddings_reach_the_routes_model_and_are_counted() {
    let embed = |served: &Served, body: Value| {
        let url = format!("{}/v1/embeddings", served.base);
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let embedded = Kernel::builder().build().unwrap();
    let served = Served::start(embedded, config()).await;
    let (status, body) = embed(
        &served,
        json!({ "model": "scripted", "input": ["a cat", "a dog", "a cat"] }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], "scripted");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 16);
    assert_eq!(data[0]["embedding"], data[2]["embedding"]);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    for bad in [
        json!({ "input": "x" }),
        json!({ "model": "scripted" }),
        json!({ "model": "scripted", "input": 5 }),
        json!({ "model": "scripted", "input": [] }),
        json!({ "model": "scripted", "input": [[1, 2], []] }),
        json!({ "model": "scripted", "input": "x", "encoding_format": "hex" }),
        // Token ids, which the embedded model cannot read.
        json!({ "model": "scripted", "input": [17, 42] }),
    ] {
        let (status, body) = embed(&served, bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }
    let (status, body) = embed(
        &served,
        json!({ "model": "scripted", "input": "a cat", "encoding_format": "base64" }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let base64 = body["data"][0]["embedding"].as_str().unwrap();
    assert_eq!(base64.len(), 88, "16 f32s in base64: {base64}");
    let (status, _) = embed(&served, json!({ "model": "nobody", "input": "x" })).await;
    assert_eq!(status, 404);
    let (_, metrics) = served.get("/metrics").await;
    let counted =
        r#"shallot_gateway_requests_total{model="scripted",mode="embeddings",status="200"} 2"#;
    assert!(metrics.contains(counted), "{metrics}");
    served.stop().await.unwrap();

    let vectors = json!({ "object": "list", "data": [{ "object": "embedding", "index": 0, "embedding": [0.5, 0.5] }], "model": "text-embedding-3-small", "usage": { "prompt_tokens": 2, "total_tokens": 2 } });
    let unreadable = json!({ "object": "list", "data": "no vectors" });
    let upstream = FakeProvider::start(vec![
        Canned::Json(200, vectors, vec![]),
        Canned::Json(200, unreadable, vec![]),
    ])
    .await;
    let model = shallot::OpenAiModel::new(shallot::OpenAiConfig::new(
        upstream.url.clone(),
        "text-embedding-3-small",
    ))
    .unwrap();
    let served = Served::start(Kernel::builder().model(model).build().unwrap(), config()).await;
    let (status, body) = embed(
        &served,
        json!({ "model": "scripted", "input": "two words", "dimensions": 2, "input_type": "query" }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"][0]["embedding"], json!([0.5, 0.5]));
    let asked = &upstream.bodies()[0];
    assert_eq!(
        asked["model"], "text-embedding-3-small",
        "the upstream is asked for its own model"
    );
    assert_eq!(asked["input"], "two words");
    assert_eq!(asked["dimensions"], 2);
    assert_eq!(
        asked["input_type"], "query",
        "a compatible server's own field"
    );
    assert_eq!(body["usage"]["prompt_tokens"], 2);
    let (status, body) = embed(&served, json!({ "model": "scripted", "input": "x" })).await;
    assert_eq!(
        status, 502,
        "an upstream's answer that is not embeddings: {body}"
    );
    served.stop().await.unwrap();

    let served = Served::start(
        kernel(vec![], ScriptedModel::answer("no vectors")).await,
        config(),
    )
    .await;
    let (status, body) = embed(&served, json!({ "model": "scripted", "input": "x" })).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("has no embeddings"),
        "{body}"
    );
    served.stop().await.unwrap();
}

/// A route whose model is the gateway itself: each call to it is one hop
/// further (`x-shallot-hops`), and at the eighth the gateway answers `400
/// loop_detected` (not retried), so the request ends with an error naming the loop
/// instead of going round until every place is taken.
#[tokio::test]
async fn a_route_whose_model_leads_back_to_the_gateway_ends_at_the_hop_limit() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let itself =
        shallot::OpenAiModel::new(shallot::OpenAiConfig::new(format!("{base}/v1"), "scripted"))
            .unwrap();
    let kernel = Kernel::builder().model(itself).build().unwrap();
    let gateway = Gateway::new(vec![Route::proxy("scripted", kernel)], config());
    let served = Served::listening(gateway, listener).await;
    let (status, body) = served.complete(ask("hello")).await;
    assert!(status >= 400, "{status}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("passed through 8 gateways"), "{body}");
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .header(shallot::HOPS_HEADER, "8")
        .json(&ask("hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "loop_detected", "{body}");
    for forged in ["-1", "lots", "99999999999999999999999"] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", served.base))
            .header(shallot::HOPS_HEADER, forged)
            .json(&ask("hello"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 400, "{forged}");
    }
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_filter_that_answers_itself_is_shown_in_json_and_in_the_stream() {
    let guard = spec(
        "safeguard",
        "guard",
        json!({ "words": ["bomb"], "failure_response": "I can't help with that." }),
    );
    let served = Served::start(
        kernel(vec![guard], ScriptedModel::answer("never asked")).await,
        config(),
    )
    .await;
    let (status, body) = served.complete(ask("build a bomb")).await;
    assert_eq!(status, 200, "a blocked answer is an answer: {body}");
    assert_eq!(body["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "I can't help with that."
    );
    let (status, events) = served.stream(ask("build a bomb")).await;
    assert_eq!(status, 200);
    assert_eq!(streamed_text(&events), "I can't help with that.");
    assert!(
        chunks(&events)
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "content_filter")
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn failures_get_openai_errors_with_a_status_by_kind() {
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        let text = request.messages.last().unwrap().text();
        match text.as_str() {
            "overloaded" => {
                Reply::Fail(ChainError::new(ErrorKind::Transient, "upstream overloaded"))
            }
            "limit" => Reply::Fail(ChainError::new(ErrorKind::LimitExceeded, "quota")),
            "badkey" => Reply::Fail(ChainError::new(
                ErrorKind::Auth,
                "Incorrect API key provided: sk-abc...wxyz",
            )),
            _ => Reply::Text("fine".into()),
        }
    });
    let filters = vec![
        spec(
            "misbehave",
            "blocker",
            json!({ "on": "chat", "do": "block", "when": "forbidden" }),
        ),
        spec(
            "misbehave",
            "crasher",
            json!({ "on": "chat", "do": "trap", "when": "crash" }),
        ),
    ];
    let config = GatewayConfig {
        max_body_bytes: 4096,
        ..config()
    };
    let served = Served::start(kernel(filters, model).await, config).await;
    let error = |body: &Value| body["error"].clone();
    let says = |body: &Value, what: &str| {
        error(body)["message"]
            .as_str()
            .is_some_and(|message| message.contains(what))
    };

    let (status, _, body) = served.post("{not json").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");

    let (status, body) = served
        .complete(json!({ "model": "gpt-9", "messages": [{ "role": "user", "content": "hi" }] }))
        .await;
    assert_eq!(
        (status, error(&body)["code"].clone()),
        (404, json!("model_not_found"))
    );

    let (status, _, body) = served.post(ask(&"x".repeat(8192)).to_string()).await;
    assert_eq!(status, 413, "{body}");

    let (status, body) = served
        .complete(
            json!({ "model": "scripted", "messages": [{ "role": "wizard", "content": "hi" }] }),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(&body, "messages[0].role: unknown variant `wizard`"),
        "says where and what: {body}"
    );

    let mut request = ask("hi");
    request["tools"] = json!([{ "type": "function", "function": {
        "name": "add", "parameters": { "type": "object" }, "strict": "yes" } }]);
    let (status, body) = served.complete(request).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(
            &body,
            "tools[0].function.strict: invalid type: string \"yes\", expected a boolean"
        ),
        "{body}"
    );

    let (status, body) = served.complete(ask("forbidden words")).await;
    assert_eq!(
        (status, error(&body)["code"].clone()),
        (400, json!("content_filter")),
        "{body}"
    );

    let (status, body) = served.complete(ask("crash now")).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(error(&body)["code"], "plugin_fault");
    assert!(says(&body, "crasher"), "names the filter: {body}");
    for internal in [".wasm", "backtrace", "it wrote"] {
        assert!(
            !says(&body, internal),
            "no plugin file, backtrace or stderr reaches a client ({internal}): {body}"
        );
    }

    let (status, body) = served.complete(ask("overloaded")).await;
    assert_eq!(status, 502, "{body}");
    let (status, retry, body) = served.post(ask("limit").to_string()).await;
    assert_eq!(
        (status, retry),
        (429, None),
        "a quota is not worth an immediate retry: {body}"
    );
    let (status, _, body) = served.post(ask("badkey").to_string()).await;
    assert_eq!(
        status, 502,
        "the gateway's own credentials are not the client's problem: {body}"
    );
    assert!(
        !body.contains("sk-abc"),
        "the model server's words are not repeated: {body}"
    );
    let (status, body) = served
        .complete(json!({ "model": "scripted", "messages": [{ "role": "user", "content": "hi" }], "tools": null, "stream": null, "n": null }))
        .await;
    assert_eq!(
        status, 200,
        "nulls mean defaults, as OpenAI reads them: {body}"
    );
    for (n, expected) in [(json!(1.0), 200), (json!(2), 400)] {
        let (status, body) = served
            .complete(json!({ "model": "scripted", "messages": [{ "role": "user", "content": "hi" }], "n": n }))
            .await;
        assert_eq!(status, expected, "n: {n}: {body}");
    }
    for (option, says_what) in [
        (json!({ "temperature": "hot" }), "temperature"),
        (
            json!({ "tool_choice": "sometimes" }),
            "`tool_choice`: must be",
        ),
        (json!({ "stop": [1, 2] }), "stop"),
    ] {
        let mut request = ask("hi");
        for (key, value) in option.as_object().unwrap() {
            request[key] = value.clone();
        }
        let (status, body) = served.complete(request).await;
        assert_eq!(
            status, 400,
            "an option of the wrong shape: {option}: {body}"
        );
        assert!(body.to_string().contains(says_what), "{option}: {body}");
    }
    let (status, body) = served.get("/v1/chat/completions").await;
    assert_eq!(status, 405, "{body}");
    assert!(body.contains("method_not_allowed"), "{body}");
    served.stop().await.unwrap();
}

/// A request past the gateway's deadline is answered `504`, whole or
/// streamed (before its first token), and the next request is served.
#[tokio::test]
async fn a_request_past_its_deadline_is_answered_504_and_the_next_is_served() {
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        match request.messages.last().unwrap().text().as_str() {
            "slowly" => Reply::Slow(Duration::from_secs(3600), "late".into()),
            _ => Reply::Text("fine".into()),
        }
    });
    let config = GatewayConfig {
        request_timeout: Duration::from_millis(300),
        ..config()
    };
    let served = Served::start(kernel(vec![], model).await, config).await;
    let (status, body) = served.complete(ask("slowly")).await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (504, json!("timeout")),
        "{body}"
    );
    let (status, events) = served.stream(ask("slowly")).await;
    assert_eq!(
        status, 504,
        "a stream that fails before its first token gets a status: {events:?}"
    );
    let (status, body) = served.complete(ask("still fine")).await;
    assert_eq!(
        (status, body["choices"][0]["message"]["content"].clone()),
        (200, json!("fine"))
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_stream_that_fails_after_it_started_ends_with_an_error_event() {
    let model = ScriptedModel::replies(vec![Reply::BreakAfter(
        vec!["half an ".into(), "answer".into()],
        ChainError::new(ErrorKind::Transient, "connection reset"),
    )]);
    let served = Served::start(kernel(vec![], model).await, config()).await;
    let (status, events) = served.stream(ask("hi")).await;
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&events);
    let last = chunks.last().unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connection reset"),
        "{events:?}"
    );
    assert!(
        !chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "stop"),
        "{events:?}"
    );
    let (_, metrics) = served.get("/metrics").await;
    for line in [
        r#"shallot_gateway_requests_total{model="scripted",mode="stream",status="200"} 1"#,
        r#"shallot_gateway_stream_errors_total{model="scripted",status="502"} 1"#,
    ] {
        assert!(
            metrics.contains(line),
            "a broken stream is counted as such: {line}\n{metrics}"
        );
    }
    served.stop().await.unwrap();
}

/// Two requests at once to `served`, whose model holds each answer until
/// `gate` opens: the one that finishes first (refused, while the other
/// holds the place) as (status, Retry-After); then, the gate opened, the
/// other's status.
async fn one_refused_while_one_holds(
    served: &Served,
    gate: &tokio::sync::Semaphore,
) -> ((u16, Option<String>), u16) {
    let body = ask("hi").to_string();
    let a = std::pin::pin!(served.post(body.clone()));
    let b = std::pin::pin!(served.post(body));
    let (refused, other) = match futures::future::select(a, b).await {
        futures::future::Either::Left((refused, other))
        | futures::future::Either::Right((refused, other)) => (refused, other),
    };
    gate.add_permits(1);
    let (served_status, _, _) = other.await;
    ((refused.0, refused.1), served_status)
}

#[tokio::test]
async fn a_full_queue_is_refused_at_once_and_a_long_wait_runs_out() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = || {
        let gate = gate.clone();
        ScriptedModel::new(move |_, _: &ChatRequest| Reply::Gated(gate.clone(), "done".into()))
    };
    // One place, no queue: of two requests at once one is served, one refused.
    let config = GatewayConfig {
        max_concurrent: 1,
        max_queued: 0,
        ..config()
    };
    let served = Served::start(kernel(vec![], held()).await, config).await;
    assert_eq!(
        one_refused_while_one_holds(&served, &gate).await,
        ((429, Some("1".to_owned())), 200)
    );
    served.stop().await.unwrap();

    // One place, one in the queue for 50 ms.
    let config = GatewayConfig {
        max_concurrent: 1,
        max_queued: 1,
        queue_timeout: Duration::from_millis(50),
        ..self::config()
    };
    let served = Served::start(kernel(vec![], held()).await, config).await;
    assert_eq!(
        one_refused_while_one_holds(&served, &gate).await,
        ((503, Some("1".to_owned())), 200)
    );
    served.stop().await.unwrap();
}

/// Reads from `stream` until the gateway closes it; what it sent. Fails
/// the test if it is still open after a minute.
pub(crate) async fn read_until_closed(stream: &mut tokio::net::TcpStream) -> String {
    let mut read = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut read)).await;
    assert!(closed.is_ok(), "the connection is still open");
    String::from_utf8_lossy(&read).into_owned()
}

#[tokio::test]
async fn a_connection_that_sends_its_request_too_slowly_or_sits_idle_is_closed() {
    let config = GatewayConfig {
        read_timeout: Duration::from_millis(300),
        ..config()
    };
    let served = Served::start(kernel(vec![], ScriptedModel::answer("hi")).await, config).await;
    let address = served.base.trim_start_matches("http://").to_owned();

    // Slowloris: the start of a head, then nothing.
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut slow).await;
    assert!(!answer.contains("200"), "{answer}");

    // A whole head, then a body that never ends.
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    let answer = read_until_closed(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 300 ms"), "{answer}");

    // A kept-alive connection: one answer, then closed once idle.
    let mut idle = tokio::net::TcpStream::connect(&address).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut idle).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // The gateway serves on.
    assert_eq!(served.get("/healthz").await.0, 200);
    served.stop().await.unwrap();
}

#[tokio::test]
async fn connections_past_the_cap_wait_until_one_closes() {
    let config = GatewayConfig {
        max_connections: 1,
        ..config()
    };
    let served = Served::start(kernel(vec![], ScriptedModel::answer("hi")).await, config).await;
    let address = served.base.trim_start_matches("http://").to_owned();
    let holder = tokio::net::TcpStream::connect(&address).await.unwrap();

    let waiting = tokio::spawn(reqwest::get(format!("{}/metrics", served.base)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a connection past the cap is served"
    );

    drop(holder);
    let metrics = waiting.await.unwrap().unwrap().text().await.unwrap();
    assert!(
        metrics.contains("shallot_gateway_connections 1"),
        "only the scrape's own connection is open: {metrics}"
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn shutting_down_lets_the_requests_in_flight_finish() {
    let model = ScriptedModel::new(|_, _: &ChatRequest| {
        Reply::Slow(Duration::from_millis(500), "finished".into())
    });
    let served = Served::start(kernel(vec![], model.clone()).await, config()).await;
    let in_flight = served.in_flight(ask("hi"));
    // The request reaches the model before the shutdown starts.
    model.reached(1).await;
    let base = served.base.clone();
    served.stop().await.unwrap();
    let body = in_flight.await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "finished");
    assert!(
        reqwest::get(format!("{base}/healthz")).await.is_err(),
        "a stopped gateway accepts nothing"
    );
}

#[tokio::test]
async fn a_swapped_kernel_serves_new_requests_while_those_in_flight_finish_on_theirs() {
    let slow_a = ScriptedModel::new(|_, _: &ChatRequest| {
        Reply::Slow(Duration::from_millis(400), "from a".into())
    });
    let gateway = Gateway::new(
        vec![Route::proxy(
            "scripted",
            kernel(vec![], slow_a.clone()).await,
        )],
        config(),
    );
    let served = Served::gateway(gateway.clone()).await;
    let in_flight = served.in_flight(ask("hi"));
    slow_a.reached(1).await;
    gateway.swap(vec![Route::proxy(
        "scripted",
        kernel(vec![], ScriptedModel::answer("from b")).await,
    )]);
    let (status, body) = served.complete(ask("hi")).await;
    assert_eq!(
        (status, body["choices"][0]["message"]["content"].clone()),
        (200, json!("from b"))
    );
    let body = in_flight.await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"], "from a",
        "it finished on its kernel"
    );

    gateway.reload_failed("plugins/broken.wasm: not a component");
    let (_, ready) = served.get("/readyz").await;
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["reloads"]["swapped"], 1);
    assert_eq!(ready["reloads"]["failed"], 1);
    assert_eq!(
        ready["reloads"]["last_error"],
        "plugins/broken.wasm: not a component"
    );
    let (status, body) = served.complete(ask("hi")).await;
    assert_eq!(
        (status, body["choices"][0]["message"]["content"].clone()),
        (200, json!("from b")),
        "the last good set serves"
    );
    served.stop().await.unwrap();
}

/// Answers with the values the gateway put in the context under these
/// keys, joined by " of " (absent ones as `null`).
struct Says(&'static [&'static str]);

#[async_trait::async_trait]
impl shallot::Filter for Says {
    fn name(&self) -> &str {
        "says"
    }

    async fn around_chat(
        &self,
        _: ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        let context = next.context();
        let said: Vec<String> = self
            .0
            .iter()
            .map(|key| context.get(key).unwrap_or_default().to_string())
            .collect();
        Ok(shallot::types::ChatResponse::new(
            shallot::types::Message::assistant(said.join(" of ")),
            shallot::types::FinishReason::Complete,
        ))
    }
}

/// A gateway behind two keys (`sk-billing`: key "billing", tenant "acme";
/// `sk-ops`: key "ops", no tenant) whose answer says the context `fields`.
async fn keyed(fields: &'static [&'static str]) -> Served {
    let kernel = Kernel::builder().filter(Says(fields)).build().unwrap();
    let gateway = Gateway::new(vec![Route::proxy("scripted", kernel)], config());
    gateway.set_keys(vec![
        shallot::ClientKey::new("billing", Some("acme".into()), "sk-billing"),
        shallot::ClientKey::new("ops", None, "sk-ops"),
    ]);
    Served::gateway(gateway).await
}

#[tokio::test]
async fn with_keys_a_client_must_present_one_and_filters_see_whose_it_is() {
    let served = keyed(&["key", "tenant"]).await;
    let post = |key: Option<&'static str>| {
        let url = format!("{}/v1/chat/completions", served.base);
        async move {
            let mut request = reqwest::Client::new().post(url).json(&ask("hi"));
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            let response = request.send().await.unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap(),
            )
        }
    };
    let (status, body) = post(None).await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = post(Some("sk-wrong")).await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (401, json!("invalid_api_key"))
    );
    assert!(
        !body.to_string().contains("sk-"),
        "no key is echoed: {body}"
    );
    let (status, body) = post(Some("sk-billing")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "\"billing\" of \"acme\""
    );
    for header in [
        "bearer sk-billing",
        "BEARER\tsk-billing",
        "  Bearer   sk-billing ",
    ] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", served.base))
            .header("authorization", header)
            .json(&ask("hi"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "the scheme in any case: {header:?}");
    }
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .header("authorization", "Basic sk-billing")
        .json(&ask("hi"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401, "another scheme is no key");
    let (status, _) = served.get("/v1/models").await;
    assert_eq!(status, 401, "the models list needs a key too");
    assert_eq!(served.get("/healthz").await.0, 200, "probes do not");
    served.stop().await.unwrap();
}

/// Every API is behind the same bounds, each answering in its own error
/// shape: a request without a key is refused from its head, before any of
/// its body comes (with an hour's read timeout, a gateway that waited for
/// the body would not answer at all), and is counted.
#[tokio::test]
async fn every_api_refuses_a_keyless_request_from_its_head_in_its_own_error_shape() {
    let gateway = Gateway::new(
        vec![Route::proxy(
            "scripted",
            kernel(vec![], ScriptedModel::answer("hi")).await,
        )],
        GatewayConfig {
            read_timeout: Duration::from_secs(3600),
            ..config()
        },
    );
    gateway.set_keys(vec![shallot::ClientKey::new("ops", None, "sk-ops")]);
    let served = Served::gateway(gateway).await;
    let address = served.base.trim_start_matches("http://").to_owned();
    for (path, mode, shape) in [
        ("/v1/chat/completions", "json", "/error/message"),
        ("/v1/responses", "json", "/error/message"),
        ("/v1/messages", "json", "/error/type"),
        ("/v1/embeddings", "embeddings", "/error/message"),
    ] {
        let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
             content-length: 100\r\n\r\n{{\"model\""
        );
        client.write_all(head.as_bytes()).await.unwrap();
        let (status, body) = answer_of(&mut client).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.pointer(shape).is_some(), "{path}: {body}");
        if path == "/v1/messages" {
            assert_eq!(body["type"], "error", "Anthropic's shape: {body}");
            assert_eq!(body["error"]["type"], "authentication_error", "{body}");
        }
        let counted =
            format!(r#"shallot_gateway_requests_total{{model="",mode="{mode}",status="401"}}"#);
        let (_, metrics) = served.get("/metrics").await;
        assert!(metrics.contains(&counted), "{path}: {metrics}");
    }
    served.stop().await.unwrap();
}

/// Reads one HTTP/1.1 answer from `stream` (its head, then as many bytes
/// of body as its `content-length` says): its status and its JSON body.
/// Fails the test if it has not come within a minute.
pub(crate) async fn answer_of(stream: &mut tokio::net::TcpStream) -> (u16, Value) {
    let read = async {
        let mut read = Vec::new();
        loop {
            let mut chunk = [0; 4096];
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the answer: {read:?}");
            read.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&read).into_owned();
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length = head
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().unwrap())
                })
                .expect("a content-length");
            if body.len() >= length {
                let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                return (status, serde_json::from_str(body).unwrap());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("an answer within a minute")
}

#[tokio::test]
async fn a_key_limited_to_some_models_sees_and_uses_only_those() {
    let gateway = Gateway::new(
        vec![
            Route::proxy("raw", kernel(vec![], ScriptedModel::answer("raw")).await),
            Route::proxy("filtered", kernel(vec![], ScriptedModel::answer("f")).await),
        ],
        config(),
    );
    gateway.set_keys(vec![
        shallot::ClientKey::new("billing", None, "sk-billing").for_models(["raw"]),
        shallot::ClientKey::new("ops", None, "sk-ops"),
    ]);
    let served = Served::gateway(gateway).await;
    let client = reqwest::Client::new();
    let call = |method: reqwest::Method, path: &str, key: &str, body: Option<Value>| {
        let mut request = client
            .request(method, format!("{}{path}", served.base))
            .bearer_auth(key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let complete = |model: &str, key: &'static str| {
        call(
            reqwest::Method::POST,
            "/v1/chat/completions",
            key,
            Some(ask_model(model)),
        )
    };
    let ids = |models: &Value| -> Vec<String> {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    };

    let (status, body) = complete("raw", "sk-billing").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = complete("filtered", "sk-billing").await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (404, json!("model_not_found")),
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.ends_with("serves raw"),
        "names only what the key may use: {message}"
    );
    let (status, body) = complete("filtered", "sk-ops").await;
    assert_eq!(status, 200, "an unlimited key uses every route: {body}");

    let (_, models) = call(reqwest::Method::GET, "/v1/models", "sk-billing", None).await;
    assert_eq!(ids(&models), ["raw"]);
    let (_, models) = call(reqwest::Method::GET, "/v1/models", "sk-ops", None).await;
    assert_eq!(ids(&models), ["raw", "filtered"]);

    let (status, model) = call(reqwest::Method::GET, "/v1/models/raw", "sk-billing", None).await;
    assert_eq!(status, 200, "{model}");
    assert_eq!(
        (model["id"].clone(), model["object"].clone()),
        (json!("raw"), json!("model"))
    );
    let (status, body) = call(
        reqwest::Method::GET,
        "/v1/models/filtered",
        "sk-billing",
        None,
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (404, json!("model_not_found"))
    );
    let (status, _) = call(reqwest::Method::GET, "/v1/models/filtered", "sk-ops", None).await;
    assert_eq!(status, 200);
    let (status, _) = call(reqwest::Method::GET, "/v1/models/raw", "sk-wrong", None).await;
    assert_eq!(status, 401, "retrieving a model needs a key too");
    served.stop().await.unwrap();
}

/// A reload replaces the keys and the routes they name in one step: while
/// reloads alternate between a route `a` for a key limited to `a` and a
/// route `b` for the key limited to `b`, the key never finds itself with
/// no model (new keys with old routes) however the requests fall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_swaps_the_keys_and_the_routes_they_name_together() {
    let kernels = [
        kernel(vec![], ScriptedModel::answer("a")).await,
        kernel(vec![], ScriptedModel::answer("b")).await,
    ];
    let set = move |round: usize| {
        let model = ["a", "b"][round % 2];
        (
            vec![Route::proxy(model, kernels[round % 2].clone())],
            vec![shallot::ClientKey::new("billing", None, "sk-billing").for_models([model])],
        )
    };
    let (routes, keys) = set(0);
    let gateway = Gateway::new(routes, config());
    gateway.set_keys(keys);
    let served = Served::gateway(gateway.clone()).await;
    let done = Arc::new(AtomicBool::new(false));
    let reloading = std::thread::spawn({
        let done = done.clone();
        move || {
            let mut round = 0;
            while !done.load(Ordering::Relaxed) {
                round += 1;
                let (routes, keys) = set(round);
                gateway.swap_with_keys(routes, keys);
            }
            round
        }
    });
    let client = reqwest::Client::new();
    let mut empty = 0;
    for _ in 0..2000 {
        let response = client
            .get(format!("{}/v1/models", served.base))
            .bearer_auth("sk-billing")
            .send()
            .await
            .unwrap();
        let models: Value = response.json().await.unwrap();
        if models["data"].as_array().unwrap().is_empty() {
            empty += 1;
        }
    }
    done.store(true, Ordering::Relaxed);
    let rounds = reloading.join().unwrap();
    assert!(rounds > 100, "reloads ran alongside: {rounds}");
    assert_eq!(empty, 0, "lists without the key's model, of 2000");
    served.stop().await.unwrap();
}

#[tokio::test]
async fn metrics_count_requests_tokens_places_and_reloads_for_prometheus() {
    let hello = kernel(vec![], ScriptedModel::answer("hello")).await;
    let gateway = Gateway::new(vec![Route::proxy("scripted", hello)], config());
    let served = Served::gateway(gateway.clone()).await;
    served.complete(ask("hi")).await;
    served.complete(ask("hi")).await;
    served.stream(ask("hi")).await;
    served
        .complete(json!({ "model": "made-up", "messages": [] }))
        .await;
    let passing = kernel(
        vec![spec("passthrough", "pass", json!(null))],
        ScriptedModel::answer("hi"),
    )
    .await;
    gateway.swap(vec![Route::proxy("scripted", passing)]);
    gateway.reload_failed("broken");
    let (status, metrics) = served.get("/metrics").await;
    assert_eq!(status, 200);
    for line in [
        r#"shallot_gateway_requests_total{model="scripted",mode="json",status="200"} 2"#,
        r#"shallot_gateway_requests_total{model="scripted",mode="stream",status="200"} 1"#,
        r#"shallot_gateway_requests_total{model="",mode="json",status="404"} 1"#,
        r#"shallot_gateway_request_seconds_count{model="scripted"} 3"#,
        r#"shallot_gateway_requests_in_progress 0"#,
        r#"shallot_gateway_requests_waiting 0"#,
        r#"shallot_gateway_filters 1"#,
        // This scrape's, and those of clients that closed but whose
        // close the gateway has not yet seen.
        "\nshallot_gateway_connections ",
        r#"shallot_gateway_reloads_total{outcome="swapped"} 1"#,
        r#"shallot_gateway_reloads_total{outcome="failed"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    assert!(
        metrics.contains(r#"shallot_gateway_tokens_total{model="scripted",direction="out"}"#),
        "{metrics}"
    );
    assert!(
        !metrics.contains("made-up"),
        "labels are never what a client made up"
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn metrics_tell_each_filters_calls_own_time_errors_tokens_and_instances() {
    let filters = vec![
        spec("passthrough", "pass", json!(null)),
        spec("copy_tokens", "copy", json!(null)),
        spec(
            "misbehave",
            "breaker",
            json!({ "on": "chat", "do": "trap", "when": "boom" }),
        ),
    ];
    let kernel = kernel(filters, ScriptedModel::answer("one two three")).await;
    let gateway = Gateway::new(vec![Route::proxy("scripted", kernel)], config());
    let served = Served::gateway(gateway.clone()).await;
    served.complete(ask("hi")).await;
    served.stream(ask("hi")).await;
    served.complete(ask("boom")).await;
    let (_, metrics) = served.get("/metrics").await;
    for line in [
        r#"shallot_gateway_filter_calls_total{filter="pass",call="around-chat"} 3"#,
        r#"shallot_gateway_filter_calls_total{filter="breaker",call="around-chat"} 3"#,
        r#"shallot_gateway_filter_own_seconds_count{filter="pass",call="around-chat"} 3"#,
        r#"shallot_gateway_filter_own_seconds_bucket{le="+Inf",filter="pass",call="around-chat"} 3"#,
        r#"shallot_gateway_filter_errors_total{filter="breaker",call="around-chat",kind="plugin-fault"} 1"#,
        r#"shallot_gateway_filter_instances{filter="pass",state="in_use"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    assert!(
        !metrics.contains(r#"filter_errors_total{filter="pass""#),
        "the failure is the breaker's own, not its outer layer's: {metrics}"
    );
    let tokens_in = metrics
        .lines()
        .find(|l| {
            l.starts_with(r#"shallot_gateway_filter_tokens_total{filter="copy",direction="in"}"#)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("tokens through the copying transformer");
    assert!(tokens_in >= 1, "{metrics}");
    assert!(
        metrics.contains(r#"filter_tokens_total{filter="pass",direction="in"} 0"#),
        "a pass-through transform is never opened: {metrics}"
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn routes_give_each_model_its_filters_and_an_agent_route_runs_the_tool_loop() {
    let redact = spec(
        "token_redact",
        "redact",
        json!({ "pattern": "sk-[a-z]+", "replacement": "[KEY]", "window": 16 }),
    );
    let leaky = || ScriptedModel::answer("the key is sk-abc");
    let filtered = kernel(vec![redact], leaky()).await;
    let raw = kernel(vec![], leaky()).await;
    // The agent route's model asks for the tool, then answers with its result.
    let agent_model = ScriptedModel::new(|_, request: &ChatRequest| {
        match request.messages.last().map(|m| m.role) {
            Some(shallot::types::Role::Tool) => Reply::Text(format!(
                "the sum is {}",
                request.messages.last().unwrap().text()
            )),
            _ => Reply::call("add", json!({ "a": 2, "b": 3 })),
        }
    });
    let adder = shallot::types::ToolSpec::new("add", "adds", json!({ "type": "object" }));
    let agent = Kernel::builder()
        .model(agent_model.clone())
        .tool(adder, |args: Value, _| async move {
            Ok(json!(
                args["a"].as_i64().unwrap() + args["b"].as_i64().unwrap()
            ))
        })
        .build()
        .unwrap();
    let routes = vec![
        Route::proxy("filtered", filtered),
        Route::proxy("raw", raw),
        Route {
            model: "agent".into(),
            kernel: agent,
            mode: RouteMode::Agent,
            store: None,
        },
    ];
    let served = Served::gateway(Gateway::new(routes, config())).await;
    let (_, body) = served.complete(ask_model("filtered")).await;
    assert_eq!(body["choices"][0]["message"]["content"], "the key is [KEY]");
    assert_eq!(body["model"], "filtered");
    let (_, body) = served.complete(ask_model("raw")).await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "the key is sk-abc"
    );
    let mut careful = ask_model("agent");
    careful["temperature"] = json!(0.2);
    careful["max_completion_tokens"] = json!(50);
    let (status, body) = served.complete(careful).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"], "the sum is 5",
        "the tool ran server-side"
    );
    let asked = agent_model.requests();
    assert_eq!(asked.len(), 2, "a round for the call, one for the answer");
    for request in &asked {
        assert_eq!(
            (
                request.options.temperature,
                request.options.max_completion_tokens
            ),
            (Some(0.2), Some(50)),
            "the client's options reach each model call of the turn"
        );
    }
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let (status, events) = served.stream(ask_model("agent")).await;
    assert_eq!(status, 200);
    assert!(
        streamed_text(&events).ends_with("the sum is 5"),
        "{events:?}"
    );
    let mut with_tools = ask_model("agent");
    with_tools["tools"] = json!([{ "type": "function", "function": { "name": "x" } }]);
    let (status, body) = served.complete(with_tools).await;
    assert_eq!(status, 400, "an agent route runs its own tools: {body}");
    let (_, models) = served.get("/v1/models").await;
    let models: Value = serde_json::from_str(&models).unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["filtered", "raw", "agent"]);
    let (_, ready) = served.get("/readyz").await;
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["routes"][2]["mode"], "agent");
    assert_eq!(ready["routes"][0]["filters"][0]["name"], "redact");
    served.stop().await.unwrap();
}

/// A gateway with one place and no queue, whose model answers "long" with
/// `long()` and anything else with "quick"; and the model.
async fn one_place(long: impl Fn() -> Reply + Send + Sync + 'static) -> (Served, ScriptedModel) {
    let model = ScriptedModel::new(move |_, request: &ChatRequest| {
        match request.messages.last().unwrap().text().as_str() {
            "long" => long(),
            _ => Reply::Text("quick".into()),
        }
    });
    let config = GatewayConfig {
        max_concurrent: 1,
        max_queued: 0,
        ..config()
    };
    let served = Served::start(kernel(vec![], model.clone()).await, config).await;
    (served, model)
}

/// Waits, at most `within`, for the one place of `served` to be free
/// again: a request answered "quick", after `429`s meanwhile.
async fn place_comes_back(served: &Served, within: Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let (status, retry, body) = served.post(ask("next").to_string()).await;
        if status == 200 {
            assert!(body.contains("quick"), "{body}");
            return;
        }
        assert_eq!((status, retry.as_deref()), (429, Some("1")), "{body}");
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_client_that_goes_away_gives_its_place_back_and_stops_its_chat() {
    let (served, model) = one_place(|| Reply::Slow(Duration::from_secs(3600), "late".into())).await;
    for stream in [false, true] {
        let mut slow = ask("long");
        slow["stream"] = json!(stream);
        let reached = model.calls() + 1;
        let gone = served.in_flight(slow);
        model.reached(reached).await;
        gone.abort();
        // The place comes back once the server sees the connection close.
        let what = format!("the place never came back (stream: {stream})");
        place_comes_back(&served, Duration::from_secs(60), &what).await;
    }
    served.stop().await.unwrap();
}

#[tokio::test]
async fn a_client_that_reads_gets_a_long_answer_whole_even_in_large_batches() {
    // Two batches of 3 MiB each, each more than MAX_UNSENT_BYTES alone.
    let big = "y".repeat(3 << 20);
    let model = ScriptedModel::replies(vec![Reply::Paced(
        vec![big.clone(), big.clone()],
        Duration::from_millis(50),
    )]);
    let served = Served::start(kernel(vec![], model).await, config()).await;
    let (status, events) = served.stream(ask("hi")).await;
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(streamed_text(&events).len(), 6 << 20);
    assert!(!events.iter().any(|e| e.contains("\"error\"")));
    served.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_does_not_read_its_stream_has_its_chat_stopped_not_buffered() {
    // A long answer, paced: 1,900 tokens of 8 KiB (15 MiB, under the
    // model's cap) over some 76 s.
    let token = "x".repeat(8 << 10);
    let (served, _) =
        one_place(move || Reply::Paced(vec![token.clone(); 1900], Duration::from_millis(40))).await;

    // A client with a small receive window asks for it and reads nothing.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let address = served.base.trim_start_matches("http://").parse().unwrap();
    let mut stalled = socket.connect(address).await.unwrap();
    let mut long = ask("long");
    long["stream"] = json!(true);
    let long = long.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: shallot\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{long}",
        long.len()
    );
    stalled.write_all(request.as_bytes()).await.unwrap();

    // Its place comes back long before the answer would have ended: the
    // chat is stopped once more than MAX_UNSENT_BYTES wait for the client.
    let what = "a stream nobody reads kept its chat running";
    place_comes_back(&served, Duration::from_secs(60), what).await;

    // Reading at last, the client gets what waited, then the error and the end.
    let mut said = Vec::new();
    let mut buffer = vec![0; 64 << 10];
    while !String::from_utf8_lossy(&said[said.len().saturating_sub(64)..]).contains("[DONE]") {
        let read = tokio::time::timeout(Duration::from_secs(60), stalled.read(&mut buffer))
            .await
            .expect("the stream ends")
            .unwrap();
        assert!(read > 0, "the connection closed before the end");
        said.extend_from_slice(&buffer[..read]);
    }
    let said = String::from_utf8_lossy(&said);
    assert!(
        said.contains("did not read the stream"),
        "{}",
        &said[said.len() - 400..]
    );
    // What waited: at most MAX_UNSENT_BYTES held by the gateway, plus what
    // the sockets' buffers took; never the whole 15 MiB answer.
    assert!(
        said.len() < shallot::MAX_UNSENT_BYTES + (6 << 20),
        "{} bytes were kept for it",
        said.len()
    );
    served.stop().await.unwrap();
}

/// Posts `text` to `served` in conversation `conversation` (the header);
/// the answer's text.
async fn say(served: &Served, conversation: &str, text: &str) -> String {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .header(shallot::CONVERSATION_HEADER, conversation)
        .json(&ask(text))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn two_replicas_share_a_conversation_through_the_memory_filter_over_redis() {
    let redis = shallot_tests::RedisServer::start();
    let replica = |engine: shallot::Engine| {
        let url = redis.url();
        async move {
            let (path, memory) = spec("memory", "memory", json!(null));
            let grants = shallot::Grants {
                memory: Some(url.into()),
                ..shallot::Grants::default()
            };
            let plugins = shallot_tests::load_in(
                &engine,
                vec![(path, shallot::FilterSpec { grants, ..memory })],
            )
            .await;
            // Answers with how many messages it was sent.
            let model = ScriptedModel::new(|_, request: &ChatRequest| {
                Reply::Text(format!("saw {}", request.messages.len()))
            });
            let kernel = Kernel::builder()
                .plugins(&plugins)
                .model(model)
                .build()
                .unwrap();
            Served::start(kernel, config()).await
        }
    };
    // Two engines stand in for two processes behind a load balancer.
    let a = replica(shallot::Engine::new(shallot::EngineConfig::default()).unwrap()).await;
    let b = replica(shallot::Engine::new(shallot::EngineConfig::default()).unwrap()).await;
    let conversation = format!("replicas-{}", std::process::id());
    assert_eq!(say(&a, &conversation, "hi").await, "saw 1");
    assert_eq!(
        say(&b, &conversation, "and then?").await,
        "saw 3",
        "B sees what A stored"
    );
    assert_eq!(say(&a, &conversation, "so?").await, "saw 5");
    let (status, body) = {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", a.base))
            .header(shallot::CONVERSATION_HEADER, "bad id with spaces")
            .json(&ask("x"))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    };
    assert_eq!(status, 400, "{body}");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test]
async fn behind_keys_a_conversation_belongs_to_the_keys_tenant() {
    let served = keyed(&["conversation_id"]).await;
    let said = |key: &'static str, conversation: &'static str| {
        let url = format!("{}/v1/chat/completions", served.base);
        async move {
            let response = reqwest::Client::new()
                .post(url)
                .bearer_auth(key)
                .header(shallot::CONVERSATION_HEADER, conversation)
                .json(&ask("hi"))
                .send()
                .await
                .unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap(),
            )
        }
    };
    let seen = |key: &'static str| async move {
        let (_, body) = said(key, "c-1").await;
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(seen("sk-billing").await, "\"acme/c-1\"");
    assert_eq!(
        seen("sk-ops").await,
        "\"ops/c-1\"",
        "a key without a tenant owns its own"
    );
    served.stop().await.unwrap();
}

#[tokio::test]
async fn answers_still_running_when_the_drain_runs_out_end_with_an_error_not_a_cut() {
    let tokens: Vec<String> = (0..100).map(|i| format!("t{i} ")).collect();
    let model = ScriptedModel::new(move |_, request: &ChatRequest| {
        if request.messages[0].text() == "slow json" {
            Reply::Slow(Duration::from_secs(30), "late".into())
        } else {
            Reply::Paced(tokens.clone(), Duration::from_millis(100))
        }
    });
    let kernel = kernel(vec![], model.clone()).await;
    let config = GatewayConfig {
        drain_timeout: Duration::from_millis(300),
        ..config()
    };
    let served = Served::start(kernel, config).await;
    let json = served.in_flight(ask("slow json"));
    let url = format!("{}/v1/chat/completions", served.base);
    let (started, streaming) = tokio::sync::oneshot::channel();
    let stream = tokio::spawn(async move {
        let mut request = ask("stream");
        request["stream"] = json!(true);
        let mut response = reqwest::Client::new()
            .post(url)
            .json(&request)
            .send()
            .await
            .unwrap();
        let mut body = Vec::new();
        let mut started = Some(started);
        while let Some(chunk) = response.chunk().await.unwrap() {
            body.extend_from_slice(&chunk);
            // Its first token, past the opening chunk.
            if body.windows(9).filter(|w| w == b"\"content\"").count() > 1
                && let Some(started) = started.take()
            {
                let _ = started.send(());
            }
        }
        String::from_utf8(body).unwrap()
    });
    model.reached(2).await;
    streaming.await.unwrap();
    served.stop().await.unwrap();
    let body = stream.await.unwrap();
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(events.len() > 2, "the stream had started: {body}");
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let error: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "an error event before [DONE]: {body}"
    );
    let answer = json.await.unwrap();
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{answer}"
    );
    assert_eq!(
        answer["error"]["code"], "overloaded",
        "the gateway's own going, to retry elsewhere, not the model server's fault: {answer}"
    );
}

/// A model whose embeddings never end; it says when one is asked for.
struct EndlessEmbeddings(Arc<tokio::sync::Notify>);

#[async_trait::async_trait]
impl shallot::ChatModel for EndlessEmbeddings {
    fn name(&self) -> &str {
        "endless"
    }

    async fn chat(
        &self,
        _: &ChatRequest,
        _: &shallot::Context,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        Err(ChainError::new(
            ErrorKind::NotFound,
            "this model only embeds",
        ))
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &shallot::Context,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<shallot::ModelEvent, ChainError>>,
        ChainError,
    > {
        Err(ChainError::new(
            ErrorKind::NotFound,
            "this model only embeds",
        ))
    }

    async fn embed(
        &self,
        _: &shallot::types::EmbeddingRequest,
        _: &shallot::Context,
    ) -> Result<shallot::types::EmbeddingResponse, ChainError> {
        self.0.notify_one();
        std::future::pending().await
    }
}

/// Embeddings in flight when a drain runs out are cut as chats are: the
/// client is told the gateway is going, to retry elsewhere, rather than
/// losing its connection.
#[tokio::test]
async fn embeddings_in_flight_when_the_drain_runs_out_are_told_to_retry() {
    let asked = Arc::new(tokio::sync::Notify::new());
    let kernel = Kernel::builder()
        .model(EndlessEmbeddings(asked.clone()))
        .build()
        .unwrap();
    let config = GatewayConfig {
        drain_timeout: Duration::from_millis(300),
        ..config()
    };
    let served = Served::start(kernel, config).await;
    let url = format!("{}/v1/embeddings", served.base);
    let embedding = tokio::spawn(async move {
        let request = json!({ "model": "scripted", "input": "hello" });
        let response = reqwest::Client::new().post(url).json(&request).send().await;
        let response = response.expect("an answer, not a dropped connection");
        (
            response.status().as_u16(),
            response.json::<Value>().await.unwrap(),
        )
    });
    asked.notified().await;
    served.stop().await.unwrap();
    let (status, answer) = embedding.await.unwrap();
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"]["code"], "overloaded", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("shutting down"), "{answer}");
}

#[tokio::test]
async fn a_request_waiting_for_a_place_when_the_drain_starts_is_told_to_retry_at_once() {
    // The first request holds the one place until the second has been
    // refused.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = gate.clone();
    let model =
        ScriptedModel::new(move |_, _: &ChatRequest| Reply::Gated(held.clone(), "served".into()));
    let config = GatewayConfig {
        max_concurrent: 1,
        max_queued: 4,
        queue_timeout: Duration::from_secs(60),
        drain_timeout: Duration::from_secs(5),
        ..config()
    };
    let served = Served::start(kernel(vec![], model.clone()).await, config).await;
    let first = served.in_flight(ask("first"));
    model.reached(1).await;
    let url = format!("{}/v1/chat/completions", served.base);
    let queued = tokio::spawn(async move {
        let response = reqwest::Client::new()
            .post(url)
            .json(&ask("second"))
            .send()
            .await
            .unwrap();
        let retry = response.headers().get("retry-after").cloned();
        (
            response.status().as_u16(),
            retry,
            response.json::<Value>().await.unwrap(),
        )
    });
    served
        .metric_reads("shallot_gateway_requests_waiting 1")
        .await;
    let stopped = tokio::spawn(served.stop());
    let (status, retry, body) = queued.await.unwrap();
    gate.add_permits(1);
    stopped.await.unwrap().unwrap();
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (503, json!("shutting_down")),
        "not admitted during the drain: {body}"
    );
    assert!(retry.is_some(), "with Retry-After");
    let first = first.await.unwrap();
    assert_eq!(
        first["choices"][0]["message"]["content"], "served",
        "the request in progress finished"
    );
}

/// An embedder serves a `shallot.toml` as `shallot serve` does: the routes
/// and keys come from `Serving::from_config`, and a route naming a filter
/// that is not loaded is a typed error naming both.
#[tokio::test]
async fn routes_and_keys_are_built_from_a_config_by_the_library() {
    let dir = shallot_tests::target_dir()
        .join("test-scratch")
        .join("routes");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let passthrough = shallot_tests::guest("passthrough");
    let write = |route_filter: &str| {
        let toml = format!(
            "[[filter]]\nname = \"pass\"\nplugin = {:?}\n\n\
             [[route]]\nmodel = \"open\"\nupstream = \"embedded\"\nfilters = [{route_filter:?}]\n\n\
             [[route]]\nmodel = \"helper\"\nmode = \"agent\"\nupstream = \"embedded\"\n\n\
             [[key]]\nname = \"app\"\nsha256 = \"{}\"\nmodels = [\"open\"]\n",
            passthrough.display().to_string(),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        );
        std::fs::write(&file, toml).unwrap();
        shallot::Config::read(&file).unwrap()
    };
    let toml = write("pass");
    let plugins = load(toml.filters().unwrap()).await;
    let shallot::Serving { routes, keys, .. } =
        shallot::Serving::from_config(Some(&toml), &plugins, None)
            .await
            .unwrap();
    let served: Vec<(&str, RouteMode, usize)> = routes
        .iter()
        .map(|r| (r.model.as_str(), r.mode, r.kernel.filters().count()))
        .collect();
    assert_eq!(
        served,
        [
            ("open", RouteMode::Proxy, 1),
            ("helper", RouteMode::Agent, 1)
        ]
    );
    assert_eq!(keys.len(), 1);
    let served = Served::gateway(Gateway::new(routes, config())).await;
    let (status, body) = served.complete(ask_model("open")).await;
    assert_eq!(status, 200, "{body}");

    let toml = write("missing");
    let Err(error) = shallot::Serving::from_config(Some(&toml), &plugins, None).await else {
        panic!("a route naming a filter that is not loaded is refused");
    };
    assert!(
        matches!(&error, shallot::RouteError::NoSuchFilter { route, filter }
            if route == "open" && filter == "missing"),
        "{error}"
    );
}
