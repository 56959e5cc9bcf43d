//! The gateway's other client APIs over HTTP on loopback: Anthropic's
//! Messages (`/v1/messages`) and OpenAI's Responses (`/v1/responses`),
//! JSON and streamed, tools both ways, the token transforms and a
//! filter's block in each API's own shape, their errors, and the
//! Responses API's kept responses (`previous_response_id`); and an
//! upstream of Anthropic's wire reached from each client API.

use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::{ChatRequest, Role, ToolChoice};
use shallot::{
    AnthropicConfig, AnthropicModel, ChainError, ClientKey, ErrorKind, Gateway, Kernel, Route,
    open_kv,
};
use shallot_tests::{AnthropicServer, Reply, ScriptedModel, spec};

use super::gateway::{Served, config, kernel};

/// Posts `body` to `path` with `headers`: the status and the body.
async fn post(
    served: &Served,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut request = reqwest::Client::new()
        .post(format!("{}{path}", served.base))
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

async fn json_of(served: &Served, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post(served, path, body, &[]).await;
    let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, body)
}

/// A stream's events: each one's name and data.
async fn events_of(served: &Served, path: &str, body: &Value) -> (u16, Vec<(String, Value)>) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = post(served, path, &body, &[]).await;
    let mut events = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(event) = line.strip_prefix("event: ") {
            name = event.to_owned();
        } else if let Some(data) = line.strip_prefix("data: ").filter(|d| *d != "[DONE]") {
            let data = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {text}"));
            events.push((std::mem::take(&mut name), data));
        }
    }
    (status, events)
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(name, _)| name.as_str()).collect()
}

/// A model that calls `add` until it sees the tool's result, then says
/// the sum.
fn adder() -> ScriptedModel {
    ScriptedModel::new(|_, request: &ChatRequest| {
        let last = request.messages.last().unwrap();
        match last.role {
            Role::Tool => Reply::Text(format!("sum is {}", last.text())),
            _ => Reply::call("add", json!({ "a": 1, "b": 2 })),
        }
    })
}

/// `token-redact` hiding keys (`sk-...`) as `[KEY]`.
fn redact() -> (std::path::PathBuf, shallot::FilterSpec) {
    spec(
        "token_redact",
        "redact",
        json!({ "pattern": "sk-[A-Za-z0-9]+", "replacement": "[KEY]", "window": 48 }),
    )
}

fn message(text: &str) -> Value {
    json!({ "model": "scripted", "max_tokens": 64, "messages": [{ "role": "user", "content": text }] })
}

#[tokio::test]
async fn the_messages_api_answers_and_streams_and_round_trips_tools_as_anthropic_does() {
    let model = adder();
    let served = Served::start(kernel(vec![], model.clone()).await, config()).await;
    let tools =
        json!([{ "name": "add", "description": "adds", "input_schema": { "type": "object" } }]);
    let mut request = message("add 1 and 2");
    request["system"] = json!([{ "type": "text", "text": "be brief" }]);
    request["tools"] = tools.clone();
    request["tool_choice"] = json!({ "type": "any", "disable_parallel_tool_use": true });
    let (status, body) = json_of(&served, "/v1/messages", &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "scripted");
    assert!(body["id"].as_str().unwrap().starts_with("msg_"), "{body}");
    assert_eq!(body["stop_reason"], "tool_use");
    let call = &body["content"][0];
    assert_eq!(call["type"], "tool_use", "{body}");
    assert_eq!(call["name"], "add");
    assert_eq!(
        call["input"],
        json!({ "a": 1, "b": 2 }),
        "input is an object"
    );
    let seen = &model.requests()[0];
    assert_eq!(seen.messages[0].role, Role::System);
    assert_eq!(seen.messages[0].text(), "be brief");
    assert_eq!(seen.tools[0].name, "add");
    assert_eq!(seen.options.max_tokens, Some(64));
    assert_eq!(seen.options.tool_choice, Some(ToolChoice::Required));
    assert_eq!(seen.options.parallel_tool_calls, Some(false));

    // The client runs the tool and sends its result back.
    let mut round = request.clone();
    round["messages"] = json!([
        request["messages"][0],
        { "role": "assistant", "content": body["content"] },
        { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": call["id"], "content": "3" }] },
    ]);
    let (status, body) = json_of(&served, "/v1/messages", &round).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["content"],
        json!([{ "type": "text", "text": "sum is 3" }])
    );
    assert_eq!(body["stop_reason"], "end_turn");
    assert!(body["usage"]["input_tokens"].is_u64(), "{body}");
    let seen = model.requests().pop().unwrap();
    assert_eq!(seen.messages[2].tool_calls[0].name, "add", "{seen:?}");
    assert_eq!(
        seen.messages[3].tool_call_id,
        call["id"].as_str().map(str::to_owned)
    );

    let (status, events) = events_of(&served, "/v1/messages", &round).await;
    assert_eq!(status, 200);
    assert_eq!(
        names(&events),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ],
        "{events:?}"
    );
    for (name, data) in &events {
        assert_eq!(&data["type"], name, "each event's type is its name");
    }
    assert_eq!(
        events[2].1["delta"],
        json!({ "type": "text_delta", "text": "sum is 3" })
    );
    assert_eq!(events[4].1["delta"]["stop_reason"], "end_turn");

    let (_, events) = events_of(&served, "/v1/messages", &request).await;
    let start = &events[1].1;
    assert_eq!(start["content_block"]["type"], "tool_use", "{events:?}");
    assert_eq!(start["content_block"]["name"], "add");
    let json = &events[2].1["delta"];
    assert_eq!(json["type"], "input_json_delta");
    let input: Value = serde_json::from_str(json["partial_json"].as_str().unwrap()).unwrap();
    assert_eq!(input, json!({ "a": 1, "b": 2 }));
    assert_eq!(events[4].1["delta"]["stop_reason"], "tool_use");
    served.stop().await.unwrap();
}

#[tokio::test]
async fn the_messages_api_fails_in_anthropics_shape_and_takes_its_key_header() {
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        match request.messages.last().unwrap().text().as_str() {
            "break" => Reply::BreakAfter(
                vec!["half an ".into()],
                ChainError::new(ErrorKind::Transient, "connection reset"),
            ),
            _ => Reply::Text("fine".into()),
        }
    });
    let gateway = Gateway::new(
        vec![Route::proxy("scripted", kernel(vec![], model).await)],
        config(),
    );
    gateway.set_keys(vec![ClientKey::new("claude", None, "sk-ant-test")]);
    let served = Served::gateway(gateway).await;
    let key = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
    ];
    let error_of = |text: &str| -> Value { serde_json::from_str(text).unwrap() };

    let (status, body) = post(&served, "/v1/messages", &message("hi"), &key).await;
    assert_eq!(status, 200, "x-api-key is a key: {body}");
    let (status, body) = post(
        &served,
        "/v1/messages",
        &message("hi"),
        &[("x-api-key", "sk-wrong")],
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(
        error_of(&body)["error"]["type"],
        "authentication_error",
        "{body}"
    );
    assert_eq!(error_of(&body)["type"], "error");
    let mut unknown = message("hi");
    unknown["model"] = json!("claude-9");
    let (status, body) = post(&served, "/v1/messages", &unknown, &key).await;
    assert_eq!(
        (status, error_of(&body)["error"]["type"].clone()),
        (404, json!("not_found_error")),
        "{body}"
    );
    let mut no_limit = message("hi");
    no_limit.as_object_mut().unwrap().remove("max_tokens");
    let (status, body) = post(&served, "/v1/messages", &no_limit, &key).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(error_of(&body)["error"]["type"], "invalid_request_error");
    assert!(body.contains("max_tokens"), "{body}");
    let mut server_tool = message("hi");
    server_tool["tools"] = json!([{ "type": "web_search_20250305", "name": "web_search" }]);
    let (status, body) = post(&served, "/v1/messages", &server_tool, &key).await;
    assert_eq!(status, 400, "{body}");

    let mut broken = message("break");
    broken["stream"] = json!(true);
    let (status, body) = post(&served, "/v1/messages", &broken, &key).await;
    assert_eq!(status, 200);
    assert!(body.contains("event: error\n"), "{body}");
    assert!(
        !body.contains("message_stop"),
        "a broken stream does not look whole: {body}"
    );
    assert!(body.contains(r#""type":"api_error""#), "{body}");
    served.stop().await.unwrap();
}

/// `token-redact` holds on every answer of both APIs, JSON and streamed,
/// and `safeguard`'s block is each API's own refusal.
#[tokio::test]
async fn redaction_and_a_filters_block_hold_in_both_apis_json_and_streamed() {
    let redact = redact();
    let guard = spec(
        "safeguard",
        "guard",
        json!({ "words": ["bomb"], "failure_response": "I can't help with that." }),
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
    let served = Served::start(kernel(vec![guard, redact], model).await, config()).await;
    let redacted = "your key: [KEY], keep it";
    let refusal = "I can't help with that.";

    let (_, body) = json_of(&served, "/v1/messages", &message("my key?")).await;
    assert_eq!(body["content"][0]["text"], redacted, "{body}");
    let (_, events) = events_of(&served, "/v1/messages", &message("my key?")).await;
    let text: String = events
        .iter()
        .filter_map(|(_, e)| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, redacted, "{events:?}");
    let (_, body) = json_of(&served, "/v1/messages", &message("build a bomb")).await;
    assert_eq!(body["content"][0]["text"], refusal, "{body}");
    assert_eq!(body["stop_reason"], "refusal");
    let (_, events) = events_of(&served, "/v1/messages", &message("build a bomb")).await;
    let delta = events
        .iter()
        .find(|(name, _)| name == "message_delta")
        .unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "refusal");

    let ask = |text: &str| json!({ "model": "scripted", "input": text });
    let (_, body) = json_of(&served, "/v1/responses", &ask("my key?")).await;
    assert_eq!(body["output"][0]["content"][0]["text"], redacted, "{body}");
    let (_, events) = events_of(&served, "/v1/responses", &ask("my key?")).await;
    let text: String = events
        .iter()
        .filter(|(name, _)| name == "response.output_text.delta")
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert_eq!(text, redacted, "{events:?}");
    assert!(!format!("{events:?}").contains("sk-live"), "{events:?}");
    let (_, body) = json_of(&served, "/v1/responses", &ask("build a bomb")).await;
    assert_eq!(body["status"], "incomplete", "{body}");
    assert_eq!(body["incomplete_details"]["reason"], "content_filter");
    assert_eq!(body["output"][0]["content"][0]["text"], refusal);
    let (_, events) = events_of(&served, "/v1/responses", &ask("build a bomb")).await;
    let (last, data) = events.last().unwrap();
    assert_eq!(last, "response.incomplete", "{events:?}");
    assert_eq!(data["response"]["output"][0]["content"][0]["text"], refusal);
    served.stop().await.unwrap();
}

#[tokio::test]
async fn the_responses_api_answers_and_streams_its_typed_events_and_round_trips_tools() {
    let model = adder();
    let served = Served::start(kernel(vec![], model.clone()).await, config()).await;
    let tools = json!([{ "type": "function", "name": "add", "description": "adds", "parameters": { "type": "object" } }]);
    let request = json!({
        "model": "scripted", "instructions": "be brief", "tools": tools,
        "input": [{ "role": "user", "content": [{ "type": "input_text", "text": "add 1 and 2" }] }],
        "store": false,
    });
    let (status, body) = json_of(&served, "/v1/responses", &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert!(body["id"].as_str().unwrap().starts_with("resp_"), "{body}");
    assert_eq!(body["instructions"], "be brief");
    let call = &body["output"][0];
    assert_eq!(call["type"], "function_call", "{body}");
    assert_eq!(call["name"], "add");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({ "a": 1, "b": 2 }));
    let seen = &model.requests()[0];
    assert_eq!(seen.messages[0].text(), "be brief");
    assert_eq!(seen.tools[0].name, "add");

    // The whole conversation back, the call and its output as items.
    let mut round = request.clone();
    round["input"] = json!([
        request["input"][0],
        call,
        { "type": "function_call_output", "call_id": call["call_id"], "output": "3" },
    ]);
    let (status, body) = json_of(&served, "/v1/responses", &round).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["output"][0]["type"], "message", "{body}");
    assert_eq!(body["output"][0]["content"][0]["text"], "sum is 3");
    assert!(body["usage"]["total_tokens"].is_u64(), "{body}");

    let (status, events) = events_of(&served, "/v1/responses", &round).await;
    assert_eq!(status, 200);
    assert_eq!(
        names(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ],
        "{events:?}"
    );
    for (n, (name, data)) in events.iter().enumerate() {
        assert_eq!(&data["type"], name);
        assert_eq!(data["sequence_number"], n, "{events:?}");
    }
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["output"][0]["content"][0]["text"], "sum is 3");
    let (_, events) = events_of(&served, "/v1/responses", &request).await;
    let arguments = events
        .iter()
        .find(|(name, _)| name == "response.function_call_arguments.delta")
        .expect("the call's arguments are streamed");
    assert!(
        arguments.1["delta"].as_str().unwrap().contains("\"a\""),
        "{events:?}"
    );
    served.stop().await.unwrap();
}

/// A route of a model that answers `answer`, keeping responses in `store`.
async fn keeping(store: std::sync::Arc<dyn shallot::KvStore>, answer: &str) -> Route {
    Route::proxy(
        "scripted",
        kernel(vec![], ScriptedModel::answer(answer)).await,
    )
    .with_store(store)
}

/// A key store that answers reads and fails every write, as a full or a
/// failing one does.
struct Unwritable;

fn full() -> ChainError {
    ChainError::new(ErrorKind::LimitExceeded, "the store is full")
}

#[async_trait::async_trait]
impl shallot::KvStore for Unwritable {
    async fn get(&self, _: &str, _: &str) -> Result<Option<shallot::Entry>, ChainError> {
        Ok(None)
    }

    async fn set(
        &self,
        _: &str,
        _: Option<&str>,
        _: &str,
        _: &str,
        _: Option<Duration>,
    ) -> Result<u64, ChainError> {
        Err(full())
    }

    async fn swap(
        &self,
        _: &str,
        _: Option<&str>,
        _: &str,
        _: &str,
        _: u64,
        _: Option<Duration>,
    ) -> Result<Option<u64>, ChainError> {
        Err(full())
    }

    async fn add(
        &self,
        _: &str,
        _: Option<&str>,
        _: &str,
        _: i64,
        _: Option<Duration>,
    ) -> Result<shallot::Count, ChainError> {
        Err(full())
    }

    async fn delete(&self, _: &str, _: &str) -> Result<bool, ChainError> {
        Ok(false)
    }

    async fn take(
        &self,
        _: &str,
        _: Option<&str>,
        _: &[shallot::Window],
    ) -> Result<shallot::Taken, ChainError> {
        Err(full())
    }

    async fn settle(
        &self,
        _: &str,
        _: &str,
        _: shallot::Period,
        _: u64,
        _: i64,
    ) -> Result<Option<u64>, ChainError> {
        Err(full())
    }
}

/// An answer the model made is delivered though keeping it failed, whole
/// or streamed, saying `store: false` (it was a `429`, and the model's
/// work was thrown away); the failure is counted in `/metrics`.
#[tokio::test]
async fn an_answer_whose_keeping_fails_is_delivered_saying_it_was_not_kept() {
    let route = keeping(std::sync::Arc::new(Unwritable), "made").await;
    let served = Served::gateway(Gateway::new(vec![route], config())).await;
    let ask = json!({ "model": "scripted", "input": "hello" });
    let (status, text) = post(&served, "/v1/responses", &ask, &[]).await;
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["store"], false, "{body}");
    assert_eq!(body["output"][0]["content"][0]["text"], "made", "{body}");
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(&served, "/v1/responses", &streamed, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("response.failed"), "{text}");
    let completed = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|e| e["type"] == "response.completed")
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(completed["response"]["store"], false, "{completed}");
    let (_, metrics) = served.get("/metrics").await;
    let failed = r#"shallot_gateway_responses_kept_total{model="scripted",outcome="failed"} 2"#;
    assert!(metrics.lines().any(|l| l == failed), "{metrics}");
    served.stop().await.unwrap();
}

/// Each tenant's kept responses are in its own part of the store, under
/// its own cap: one that fills its part (the store's one cap was every
/// tenant's, and one tenant's hundred requests made everyone's `429`)
/// gets its answers unkept (`store: false`); another keeps and continues
/// its own as before.
#[tokio::test]
async fn one_tenants_kept_responses_fill_its_own_room_not_anothers() {
    let store = open_kv(":memory:responses-fill").await.unwrap();
    let route = keeping(store, "ok").await;
    let gateway = Gateway::new(vec![route], config());
    gateway.set_keys(vec![
        ClientKey::new("hog", Some("hogs".into()), "sk-hog"),
        ClientKey::new("quiet", Some("quiet".into()), "sk-quiet"),
    ]);
    let served = Served::gateway(gateway).await;
    let megabyte = "m".repeat(1 << 20);
    let hog = [("authorization", "Bearer sk-hog")];
    let mut kept = 0;
    let stored = loop {
        let ask = json!({ "model": "scripted", "input": megabyte });
        let (status, text) = post(&served, "/v1/responses", &ask, &hog).await;
        assert_eq!(status, 200, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        if body["store"] != true || kept == 40 {
            break body["store"].clone();
        }
        kept += 1;
    };
    assert_eq!(stored, false, "a part of 16 MiB fills: {kept} kept");
    let quiet = [("authorization", "Bearer sk-quiet")];
    let ask = json!({ "model": "scripted", "input": "hello" });
    let (_, text) = post(&served, "/v1/responses", &ask, &quiet).await;
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["store"], true, "another tenant keeps its own: {body}");
    let next = json!({ "model": "scripted", "input": "again", "previous_response_id": body["id"] });
    let (status, text) = post(&served, "/v1/responses", &next, &quiet).await;
    assert_eq!(status, 200, "and continues it: {text}");
    served.stop().await.unwrap();
}

/// The id of a kept response is 128 random bits: on a gateway without
/// keys nobody continues a neighbour's response from their own id (each
/// was the last plus one), and an id spelled as another owner's key in a
/// store a keyed gateway shares (`acme/resp_...`) is no id at all.
#[tokio::test]
async fn a_kept_responses_id_is_not_guessed_from_another_nor_spelled_as_another_owners() {
    let store = open_kv(":memory:responses-ids").await.unwrap();
    let open = keeping(store.clone(), "hi").await;
    let open = Served::gateway(Gateway::new(vec![open], config())).await;
    let keyed = keeping(store, "hi").await;
    let keyed = Gateway::new(vec![keyed], config());
    keyed.set_keys(vec![ClientKey::new(
        "alice",
        Some("acme".into()),
        "sk-alice",
    )]);
    let keyed = Served::gateway(keyed).await;

    let ask = |previous: Option<&str>| json!({ "model": "scripted", "input": "hello", "previous_response_id": previous });
    let kept = |text: &str| -> String {
        let body: Value = serde_json::from_str(text).unwrap();
        body["id"].as_str().unwrap().to_owned()
    };
    let (_, victims) = post(&open, "/v1/responses", &ask(None), &[]).await;
    let (_, mine) = post(&open, "/v1/responses", &ask(None), &[]).await;
    let (victims, mine) = (kept(&victims), kept(&mine));
    for id in [&victims, &mine] {
        let bits = id.strip_prefix("resp_").unwrap();
        assert!(
            bits.len() == 32 && bits.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
    }
    let shared = victims
        .chars()
        .zip(mine.chars())
        .take_while(|(a, b)| a == b);
    assert!(
        shared.count() < 16,
        "{victims} and {mine} share their start"
    );
    let (status, _) = post(&open, "/v1/responses", &ask(Some(&mine)), &[]).await;
    assert_eq!(status, 200, "one's own continues");
    let bits = u128::from_str_radix(mine.strip_prefix("resp_").unwrap(), 16).unwrap();
    for guess in [bits.wrapping_sub(1), bits.wrapping_add(1)] {
        let guess = format!("resp_{guess:032x}");
        let (status, text) = post(&open, "/v1/responses", &ask(Some(&guess)), &[]).await;
        assert_eq!(status, 400, "{guess}: {text}");
        assert!(text.contains("previous_response_not_found"), "{text}");
    }

    let alice = [("authorization", "Bearer sk-alice")];
    let (_, acmes) = post(&keyed, "/v1/responses", &ask(None), &alice).await;
    let acmes = kept(&acmes);
    let (status, _) = post(&keyed, "/v1/responses", &ask(Some(&acmes)), &alice).await;
    assert_eq!(status, 200, "acme's own continues");
    for spelled in [
        format!("acme/{acmes}"),
        format!("by/4:acme/{acmes}"),
        format!("../by/4:acme/{acmes}"),
    ] {
        let (status, text) = post(&open, "/v1/responses", &ask(Some(&spelled)), &[]).await;
        assert_eq!(status, 400, "{spelled}: {text}");
        assert!(text.contains("previous_response_not_found"), "{text}");
    }
    open.stop().await.unwrap();
    keyed.stop().await.unwrap();
}

/// A route with a store keeps each response, under the key's tenant:
/// `previous_response_id` continues it (a tool round trip with only the
/// tool's output sent), another tenant cannot; a route without a store
/// says so rather than forgetting.
#[tokio::test]
async fn previous_response_id_continues_a_kept_response_and_without_a_store_is_a_400() {
    let model = adder();
    let store = open_kv(":memory:responses-test").await.unwrap();
    let kept = Route::proxy("scripted", kernel(vec![], model.clone()).await).with_store(store);
    let forgetful = Route::proxy("forgetful", kernel(vec![], adder()).await);
    let gateway = Gateway::new(vec![kept, forgetful], config());
    gateway.set_keys(vec![
        ClientKey::new("alice", Some("acme".into()), "sk-alice"),
        ClientKey::new("mallory", Some("evil".into()), "sk-mallory"),
    ]);
    let served = Served::gateway(gateway).await;
    let alice = [("authorization", "Bearer sk-alice")];
    let tools = json!([{ "type": "function", "name": "add", "parameters": { "type": "object" } }]);
    let first = json!({ "model": "scripted", "input": "add 1 and 2", "tools": tools, "instructions": "be brief" });
    let (status, text) = post(&served, "/v1/responses", &first, &alice).await;
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["store"], true, "a route with a store keeps by default");
    let call = &body["output"][0];
    let next = json!({
        "model": "scripted", "tools": tools, "previous_response_id": body["id"],
        "input": [{ "type": "function_call_output", "call_id": call["call_id"], "output": "3" }],
    });
    let (status, text) = post(&served, "/v1/responses", &next, &alice).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        answer["output"][0]["content"][0]["text"], "sum is 3",
        "{answer}"
    );
    let seen = model.requests().pop().unwrap();
    let roles: Vec<Role> = seen.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::Tool],
        "the kept conversation, without the first request's instructions: {seen:?}"
    );

    // A streamed response is kept as it was shown, and continues too.
    let mut streamed =
        json!({ "model": "scripted", "input": "add 1 and 2", "tools": tools, "stream": true });
    let (_, text) = post(&served, "/v1/responses", &streamed, &alice).await;
    let completed = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|e| e["type"] == "response.completed")
        .unwrap_or_else(|| panic!("{text}"));
    let id = completed["response"]["id"].clone();
    let call_id = completed["response"]["output"][0]["call_id"].clone();
    streamed = json!({
        "model": "scripted", "tools": tools, "previous_response_id": id,
        "input": [{ "type": "function_call_output", "call_id": call_id, "output": "3" }],
    });
    let (status, text) = post(&served, "/v1/responses", &streamed, &alice).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("sum is 3"), "{text}");

    let (status, text) = post(
        &served,
        "/v1/responses",
        &next,
        &[("authorization", "Bearer sk-mallory")],
    )
    .await;
    assert_eq!(
        status, 400,
        "another tenant's response is not there: {text}"
    );
    assert!(text.contains("previous_response_not_found"), "{text}");
    let mut unknown = next.clone();
    unknown["previous_response_id"] = json!("resp_nothing");
    let (status, _) = post(&served, "/v1/responses", &unknown, &alice).await;
    assert_eq!(status, 400);

    let mut forgetful = next.clone();
    forgetful["model"] = json!("forgetful");
    let (status, text) = post(&served, "/v1/responses", &forgetful, &alice).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("store_not_configured"), "{text}");
    let stored = json!({ "model": "forgetful", "input": "hi", "store": true });
    let (status, _) = post(&served, "/v1/responses", &stored, &alice).await;
    assert_eq!(status, 400, "asking to keep where nothing is kept");
    let plain = json!({ "model": "forgetful", "input": "hi" });
    let (status, text) = post(&served, "/v1/responses", &plain, &alice).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#""store":false"#), "{text}");
    served.stop().await.unwrap();
}

/// A route whose upstream speaks Anthropic's Messages (a local server of
/// its wire), reached from each client API: the request translated there
/// (system on top, tool results as blocks, the key as `x-api-key`), the
/// answer and its stream back, tools both ways, the filters on it all.
#[tokio::test]
async fn an_anthropic_upstream_is_reached_from_each_client_api() {
    let claude = AnthropicServer::start().await;
    let upstream = |model: &str| {
        let config = AnthropicConfig {
            api_key: Some("sk-ant-upstream".into()),
            max_retries: 0,
            ..AnthropicConfig::new(&claude.url, model)
        };
        AnthropicModel::new(config).unwrap()
    };
    let redact = redact();
    let plugins = shallot_tests::load(vec![redact]).await;
    let kernel = |model| {
        Kernel::builder()
            .plugins(&plugins)
            .model(model)
            .build()
            .unwrap()
    };
    let routes = vec![
        Route::proxy("scripted", kernel(upstream("claude-test"))),
        Route::proxy("busy", kernel(upstream("overloaded"))),
    ];
    let served = Served::gateway(Gateway::new(routes, config())).await;
    let chat = |text: &str| {
        json!({ "model": "scripted", "messages": [
            { "role": "system", "content": "be brief" }, { "role": "user", "content": text }] })
    };

    let (status, body) = json_of(&served, "/v1/chat/completions", &chat("hello")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "claude heard: hello"
    );
    let (head, sent) = claude.requests().pop().unwrap();
    assert!(head.contains("x-api-key: sk-ant-upstream"), "{head}");
    assert!(head.contains("anthropic-version: 2023-06-01"), "{head}");
    assert_eq!(sent["system"], "be brief", "{sent}");
    assert_eq!(
        sent["messages"],
        json!([{ "role": "user", "content": [{ "type": "text", "text": "hello" }] }])
    );
    assert_eq!(sent["max_tokens"], 4096);
    let (_, events) = events_of(&served, "/v1/chat/completions", &chat("hello")).await;
    let text: String = events
        .iter()
        .filter_map(|(_, e)| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "claude heard: hello", "{events:?}");

    // Tools through chat completions, JSON and streamed.
    let mut ask = chat("what is (2 + 3) * 4?");
    ask["tools"] = json!([{ "type": "function", "function": { "name": "calculator", "parameters": { "type": "object" } } }]);
    let (_, body) = json_of(&served, "/v1/chat/completions", &ask).await;
    let call = body["choices"][0]["message"]["tool_calls"][0].clone();
    assert_eq!(call["function"]["name"], "calculator", "{body}");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({ "expression": "(2 + 3) * 4" }));
    let (_, events) = events_of(&served, "/v1/chat/completions", &ask).await;
    let streamed = events
        .iter()
        .find_map(|(_, e)| {
            e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
        })
        .expect("a streamed tool call");
    assert_eq!(serde_json::from_str::<Value>(streamed).unwrap(), arguments);
    let mut round = ask.clone();
    let messages = round["messages"].as_array_mut().unwrap();
    messages.push(body["choices"][0]["message"].clone());
    messages.push(json!({ "role": "tool", "tool_call_id": call["id"], "content": "20" }));
    let (_, body) = json_of(&served, "/v1/chat/completions", &round).await;
    assert_eq!(
        body["choices"][0]["message"]["content"], "the tool said 20",
        "{body}"
    );
    let (_, sent) = claude.requests().pop().unwrap();
    assert_eq!(
        sent["messages"][1]["content"][0]["type"], "tool_use",
        "{sent}"
    );
    assert_eq!(sent["messages"][1]["content"][0]["input"], arguments);
    assert_eq!(
        sent["messages"][2]["content"][0],
        json!({ "type": "tool_result", "tool_use_id": "toolu_1", "content": "20" })
    );

    // OpenAI's options under Anthropic's names; OpenAI's own left out.
    let mut options = ask.clone();
    options["stop"] = json!(["END"]);
    options["tool_choice"] = json!({ "type": "function", "function": { "name": "calculator" } });
    options["parallel_tool_calls"] = json!(false);
    options["user"] = json!("u-1");
    options["temperature"] = json!(0.5);
    options["logprobs"] = json!(true);
    json_of(&served, "/v1/chat/completions", &options).await;
    let (_, sent) = claude.requests().pop().unwrap();
    assert_eq!(sent["stop_sequences"], json!(["END"]), "{sent}");
    assert_eq!(
        sent["tool_choice"],
        json!({ "type": "tool", "name": "calculator", "disable_parallel_tool_use": true })
    );
    assert_eq!(sent["metadata"], json!({ "user_id": "u-1" }));
    assert_eq!(sent["temperature"], 0.5);
    for openai in ["stop", "user", "parallel_tool_calls", "logprobs", "stream"] {
        assert!(sent.get(openai).is_none(), "{openai}: {sent}");
    }

    // The Responses and Messages APIs reach it too, the key redacted.
    let secret = "my key is sk-live4f9a2b7c";
    let (_, body) = json_of(&served, "/v1/chat/completions", &chat(secret)).await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "claude heard: my key is [KEY]"
    );
    let responses = json!({ "model": "scripted", "input": secret });
    let (_, body) = json_of(&served, "/v1/responses", &responses).await;
    assert_eq!(
        body["output"][0]["content"][0]["text"], "claude heard: my key is [KEY]",
        "{body}"
    );
    let (_, events) = events_of(&served, "/v1/responses", &responses).await;
    let done = &events.last().unwrap().1["response"];
    assert_eq!(
        done["output"][0]["content"][0]["text"],
        "claude heard: my key is [KEY]"
    );
    let (_, body) = json_of(&served, "/v1/messages", &message(secret)).await;
    assert_eq!(
        body["content"][0]["text"], "claude heard: my key is [KEY]",
        "{body}"
    );
    let (_, events) = events_of(&served, "/v1/messages", &message(secret)).await;
    let text: String = events
        .iter()
        .filter_map(|(_, e)| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "claude heard: my key is [KEY]");

    // Anthropic's 529 is the upstream's failure, a 502 to the client.
    let mut busy = chat("hello");
    busy["model"] = json!("busy");
    let (status, body) = json_of(&served, "/v1/chat/completions", &busy).await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("529"),
        "{body}"
    );
    served.stop().await.unwrap();
}

/// `/openapi.json` documents each endpoint the gateway serves, with the
/// method it takes, and nothing it does not serve.
#[tokio::test]
async fn the_openapi_document_names_every_endpoint_the_gateway_serves() {
    let served = Served::start(kernel(vec![], ScriptedModel::answer("hi")).await, config()).await;
    let (status, text) = served.get("/openapi.json").await;
    assert_eq!(status, 200);
    let document: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(document["openapi"], "3.1.0");
    let mut documented: Vec<(String, String)> = document["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |method| (method.clone(), path.clone()))
        })
        .collect();
    documented.sort();
    let mut served_here: Vec<(String, String)> = [
        ("post", "/v1/chat/completions"),
        ("post", "/v1/responses"),
        ("post", "/v1/messages"),
        ("post", "/v1/embeddings"),
        ("get", "/v1/models"),
        ("get", "/v1/models/{model}"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
    ]
    .iter()
    .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
    .collect();
    served_here.sort();
    assert_eq!(documented, served_here);
    for (method, path) in &documented {
        let url = format!("{}{}", served.base, path.replace("{model}", "scripted"));
        let request = reqwest::Client::new().request(method.to_uppercase().parse().unwrap(), url);
        let response = request.json(&json!({})).send().await.unwrap();
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        assert!(
            status != 405 && !body.contains("unknown_url"),
            "{method} {path} is served: {status} {body}"
        );
        if method == "post" {
            assert_eq!(status, 400, "an empty request is a bad one: {body}");
        }
    }
    served.stop().await.unwrap();
}

/// Hostile bodies to the new endpoints: nested a hundred thousand deep,
/// every field of the wrong type, an item of every unknown kind. Each is
/// a `400` in its API's shape, and the gateway goes on serving.
#[tokio::test]
async fn hostile_bodies_to_the_responses_and_messages_endpoints_are_400s() {
    let served = Served::start(
        kernel(vec![], ScriptedModel::answer("fine")).await,
        config(),
    )
    .await;
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let wrong_types = json!({ "model": 7, "input": { "a": 1 }, "messages": "x", "max_tokens": "many", "stream": "yes" });
    for path in ["/v1/responses", "/v1/messages"] {
        for body in [
            deep.clone(),
            wrong_types.to_string(),
            "{\"model\":".to_owned(),
        ] {
            let response = reqwest::Client::new()
                .post(format!("{}{path}", served.base))
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), 400, "{path}");
            let error: Value = response.json().await.unwrap();
            let message = if path == "/v1/messages" {
                assert_eq!(error["type"], "error", "{error}");
                &error["error"]["message"]
            } else {
                &error["error"]["message"]
            };
            assert!(message.is_string(), "{error}");
        }
    }
    // Each refusal says where in the body and what is wrong.
    let says = |body: &Value, what: &[&str]| {
        let message = body["error"]["message"].as_str().unwrap_or_default();
        what.iter().all(|part| message.contains(part))
    };
    let items = json!({ "model": "scripted", "input": [{ "type": "item_reference", "id": "x" }, { "type": "computer_call" }] });
    let (status, body) = json_of(&served, "/v1/responses", &items).await;
    assert_eq!(status, 400, "{body}");
    assert!(says(&body, &["input[0].type", "item_reference"]), "{body}");
    let call = json!({ "model": "scripted", "input": [{ "type": "function_call", "name": "add", "arguments": "{}" }] });
    let (status, body) = json_of(&served, "/v1/responses", &call).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(
            &body,
            &["input[0]: a 'function_call' item has no `call_id`"]
        ),
        "{body}"
    );
    let part = json!({ "model": "scripted", "input": [{ "role": "user", "content": [{ "type": "input_audio" }] }] });
    let (status, body) = json_of(&served, "/v1/responses", &part).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(&body, &["input[0].content[0]", "input_audio"]),
        "{body}"
    );
    let blocks = json!({ "model": "scripted", "max_tokens": 5, "messages": [
        { "role": "user", "content": [{ "type": "document", "source": {} }] }] });
    let (status, body) = json_of(&served, "/v1/messages", &blocks).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(&body, &["messages[0].content[0]", "document"]),
        "{body}"
    );
    let misplaced = json!({ "model": "scripted", "max_tokens": 5, "messages": [
        { "role": "user", "content": [{ "type": "tool_use", "id": "t", "name": "add", "input": {} }] }] });
    let (status, body) = json_of(&served, "/v1/messages", &misplaced).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        says(
            &body,
            &["messages[0]: a user message cannot hold a 'tool_use' block"]
        ),
        "{body}"
    );
    let choice = json!({ "model": "scripted", "max_tokens": 5, "tool_choice": { "type": "some" },
        "messages": [{ "role": "user", "content": "hi" }] });
    let (status, body) = json_of(&served, "/v1/messages", &choice).await;
    assert_eq!(status, 400, "{body}");
    assert!(says(&body, &["tool_choice.type", "`some`"]), "{body}");
    let (status, body) = json_of(&served, "/v1/messages", &message("still here?")).await;
    assert_eq!(
        (status, body["content"][0]["text"].clone()),
        (200, json!("fine"))
    );
    served.stop().await.unwrap();
}

/// On an agent route a Responses or Messages request is one whole turn:
/// the gateway runs its tools and the client gets the final answer, in
/// its API's words (and sending tools of its own is refused there too).
#[tokio::test]
async fn on_an_agent_route_each_api_gets_the_turns_final_answer() {
    let adder = shallot::types::ToolSpec::new("add", "adds", json!({ "type": "object" }));
    let turn = shallot::ToolLoop::new(shallot::LoopConfig::default(), shallot::NoHistory);
    let agent = Kernel::builder()
        .model(adder_model())
        .tool(adder, |args: Value, _| async move {
            Ok(json!(
                args["a"].as_i64().unwrap() + args["b"].as_i64().unwrap()
            ))
        })
        .turn_terminal(turn)
        .build()
        .unwrap();
    let route = Route {
        mode: shallot::RouteMode::Agent,
        ..Route::proxy("scripted", agent)
    };
    let served = Served::gateway(Gateway::new(vec![route], config())).await;
    let (status, body) = json_of(&served, "/v1/messages", &message("add 1 and 2")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["content"],
        json!([{ "type": "text", "text": "sum is 3" }])
    );
    assert_eq!(body["stop_reason"], "end_turn");
    let ask = json!({ "model": "scripted", "input": "add 1 and 2" });
    let (_, events) = events_of(&served, "/v1/responses", &ask).await;
    let done = &events.last().unwrap().1["response"];
    assert_eq!(
        done["output"][0]["content"][0]["text"], "sum is 3",
        "{events:?}"
    );
    let mut tools = message("add");
    tools["tools"] = json!([{ "name": "mine", "input_schema": { "type": "object" } }]);
    let (status, body) = json_of(&served, "/v1/messages", &tools).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["type"], "error");
    served.stop().await.unwrap();
}

/// A model that calls `add` with 1 and 2 until it sees the result.
fn adder_model() -> ScriptedModel {
    ScriptedModel::new(|_, request: &ChatRequest| {
        let last = request.messages.last().unwrap();
        match last.role {
            Role::Tool => Reply::Text(format!("sum is {}", last.text())),
            _ => Reply::call("add", json!({ "a": 1, "b": 2 })),
        }
    })
}
