//! The OpenAI-compatible client against a local server that speaks the
//! chat-completions wire format: plain and streamed answers, tool calls split
//! across SSE chunks, usage, every error class, and streams that break
//! (PEER-CASES P10–P25, adapted: our classes are `ChainError` kinds).

use serde_json::{Value, json};
use shallot::types::{FinishReason, Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel, OpenAiConfig, OpenAiModel};
use shallot_tests::{Canned, Collector, FakeProvider, ask, load, spec};

fn client(provider: &FakeProvider, timeout_ms: u64, max_retries: u32) -> OpenAiModel {
    let config = OpenAiConfig {
        api_key: Some("sk-test".into()),
        timeout_ms,
        max_retries,
        ..OpenAiConfig::new(&provider.url, "tiny-model")
    };
    OpenAiModel::new(config).expect("the client builds")
}

fn kernel(provider: &FakeProvider) -> Kernel {
    Kernel::builder()
        .model(client(provider, 5_000, 2))
        .build()
        .unwrap()
}

fn completion(text: &str, finish: &str) -> Canned {
    Canned::Json(
        200,
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "tiny-model-0425",
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": finish }],
            "usage": { "prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14 }
        }),
        vec![],
    )
}

fn delta(delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "tiny-model-0425",
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }]
    })
}

fn usage_chunk() -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "tiny-model-0425",
        "choices": [],
        "usage": { "prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25 }
    })
}

fn streamed(pieces: &[&str]) -> Vec<Value> {
    let mut chunks = vec![delta(json!({ "role": "assistant", "content": "" }), None)];
    chunks.extend(pieces.iter().map(|p| delta(json!({ "content": p }), None)));
    chunks.push(delta(json!({}), Some("stop")));
    chunks.push(usage_chunk());
    chunks
}

/// A failure with `status` whose answer asks the client to wait (`header`).
fn asking_to_wait(status: u16, message: &str, header: (&'static str, String)) -> Canned {
    Canned::Json(
        status,
        json!({ "error": { "message": message } }),
        vec![header],
    )
}

fn error(status: u16, message: &str) -> Canned {
    Canned::Json(
        status,
        json!({ "error": { "message": message, "type": "test" } }),
        vec![],
    )
}

#[tokio::test]
async fn a_plain_answer_comes_back_with_usage_and_the_request_goes_out_in_the_wire_format() {
    let provider = FakeProvider::start(vec![completion("Hello there.", "stop")]).await;
    let mut request =
        shallot::types::ChatRequest::new(vec![Message::system("be brief"), Message::user("hi")]);
    request.tools = std::sync::Arc::new(vec![
        ToolSpec::new(
            "add",
            "adds",
            json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
        ),
        ToolSpec::new("sub", "subtracts", json!({"type": "object"})).strict(),
    ]);
    let response = kernel(&provider)
        .chat(request, Context::new())
        .await
        .unwrap();
    assert_eq!(response.text(), "Hello there.");
    assert_eq!(response.finish_reason, FinishReason::Complete);
    assert_eq!(response.model, "tiny-model-0425");
    assert_eq!(
        (
            response.usage.input_tokens,
            response.usage.output_tokens,
            response.usage.total_tokens
        ),
        (11, 3, 14)
    );
    let body = &provider.bodies()[0];
    assert_eq!(body["model"], "tiny-model");
    assert_eq!(
        body["messages"],
        json!([{ "role": "system", "content": "be brief" }, { "role": "user", "content": "hi" }])
    );
    assert_eq!(body["tools"][0]["type"], "function");
    assert_eq!(body["tools"][0]["function"]["name"], "add");
    assert_eq!(
        body["tools"][0]["function"]["parameters"]["properties"]["a"]["type"],
        "integer"
    );
    assert!(body["tools"][0]["function"].get("strict").is_none());
    assert_eq!(body["tools"][1]["function"]["strict"], true);
    assert!(body.get("stream").is_none());
}

#[tokio::test]
async fn a_streamed_answer_arrives_token_by_token_and_ends_with_the_usage_chunk() {
    let provider =
        FakeProvider::start(vec![Canned::Sse(streamed(&["Hel", "lo", "!"]), true)]).await;
    let sink = Collector::default();
    let response = kernel(&provider)
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(sink.tokens().concat(), "Hello!");
    assert_eq!(response.text(), "Hello!");
    assert_eq!(response.finish_reason, FinishReason::Complete);
    assert_eq!(response.usage.total_tokens, 25);
    let body = &provider.bodies()[0];
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn a_server_that_closes_after_the_finish_reason_without_done_still_answers() {
    let provider = FakeProvider::start(vec![Canned::Sse(streamed(&["ok"]), false)]).await;
    let response = kernel(&provider)
        .chat_stream(ask("hi"), Context::new(), Collector::default())
        .await
        .unwrap();
    assert_eq!(response.text(), "ok");
}

/// Two tool calls whose ids, names and arguments arrive in pieces, by index.
fn split_tool_calls() -> Vec<Value> {
    let call = |index: u32, id: Option<&str>, name: Option<&str>, args: &str| {
        let mut function = json!({ "arguments": args });
        if let Some(name) = name {
            function["name"] = json!(name);
        }
        let mut piece = json!({ "index": index, "function": function });
        if let Some(id) = id {
            piece["id"] = json!(id);
            piece["type"] = json!("function");
        }
        delta(json!({ "tool_calls": [piece] }), None)
    };
    vec![
        delta(json!({ "role": "assistant", "content": null }), None),
        call(0, Some("call_a"), Some("add"), ""),
        call(0, None, None, "{\"a\": 2,"),
        call(1, Some("call_b"), Some("add"), "{\"a\""),
        call(0, None, None, " \"b\": 3}"),
        call(1, None, None, ": 10, \"b\": 5}"),
        delta(json!({}), Some("tool_calls")),
        usage_chunk(),
    ]
}

#[tokio::test]
async fn tool_calls_split_across_chunks_are_put_together_and_run_through_a_turn() {
    let provider = FakeProvider::start(vec![
        Canned::Sse(split_tool_calls(), true),
        Canned::Sse(streamed(&["5 and ", "15."]), true),
    ])
    .await;
    let spec = ToolSpec::new("add", "adds a and b", json!({"type": "object"}));
    let kernel = Kernel::builder()
        .model(client(&provider, 5_000, 0))
        .tool(spec, |args: Value, _| async move {
            Ok(json!(
                args["a"].as_i64().unwrap() + args["b"].as_i64().unwrap()
            ))
        })
        .build()
        .unwrap();
    let sink = Collector::default();
    let result = kernel
        .turn_stream(
            TurnRequest::new(vec![Message::user("2+3, 10+5?")]),
            Context::new(),
            sink.clone(),
        )
        .await;
    let TurnResult::Done(done) = result else {
        panic!("expected a done turn, got {result:?}")
    };
    assert_eq!(done.response.text(), "5 and 15.");
    let calls: Vec<(&str, &str, Option<&str>)> = done
        .tool_calls
        .iter()
        .map(|c| {
            (
                c.call.id.as_str(),
                c.call.arguments.as_str(),
                c.output.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("call_a", "{\"a\": 2, \"b\": 3}", Some("5")),
            ("call_b", "{\"a\": 10, \"b\": 5}", Some("15"))
        ]
    );
    assert_eq!(sink.tokens().concat(), "5 and 15.");
    let second = &provider.bodies()[1]["messages"];
    assert_eq!(
        second[1]["tool_calls"][1]["function"]["arguments"],
        "{\"a\": 10, \"b\": 5}"
    );
    assert_eq!(
        second[2],
        json!({ "role": "tool", "content": "5", "tool_call_id": "call_a" })
    );
    assert_eq!(
        second[3],
        json!({ "role": "tool", "content": "15", "tool_call_id": "call_b" })
    );
}

/// A 429 is retried after the server's `Retry-After`, or after the
/// backoff when the value is no duration (it panicked on a negative one).
#[tokio::test]
async fn a_429_is_retried_after_the_servers_retry_after() {
    for wait in ["0", "-1", "1e400", "NaN", "inf", "soon"] {
        let provider = FakeProvider::start(vec![
            asking_to_wait(429, "slow down", ("retry-after", wait.into())),
            completion("fine", "stop"),
        ])
        .await;
        let response = kernel(&provider)
            .chat(ask("hi"), Context::new())
            .await
            .unwrap();
        assert_eq!(response.text(), "fine", "after Retry-After: {wait}");
        assert_eq!(provider.bodies().len(), 2);
    }
}

#[tokio::test]
async fn a_5xx_that_persists_ends_as_a_transient_error_after_the_retries() {
    let provider = FakeProvider::start(vec![asking_to_wait(
        503,
        "overloaded",
        ("retry-after", "0".into()),
    )])
    .await;
    let error = kernel(&provider)
        .chat(ask("hi"), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient);
    assert!(
        error.message.contains("503") && error.message.contains("overloaded"),
        "{error}"
    );
    assert_eq!(provider.bodies().len(), 3, "the first try and two retries");
}

#[tokio::test]
async fn auth_failures_are_not_retried() {
    for status in [401, 403] {
        let provider = FakeProvider::start(vec![error(status, "bad key")]).await;
        let error = kernel(&provider)
            .chat(ask("hi"), Context::new())
            .await
            .unwrap_err();
        assert_eq!(error.kind, ErrorKind::Auth);
        assert!(error.message.contains("bad key"), "{error}");
        assert_eq!(provider.bodies().len(), 1);
    }
}

#[tokio::test]
async fn other_client_errors_are_invalid_requests_and_not_retried() {
    let provider = FakeProvider::start(vec![error(400, "context too long")]).await;
    let error = kernel(&provider)
        .chat(ask("hi"), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(error.message.contains("context too long"), "{error}");
    assert_eq!(provider.bodies().len(), 1);
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let provider = FakeProvider::start(vec![Canned::Hang]).await;
    let kernel = Kernel::builder()
        .model(client(&provider, 200, 0))
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout);
    let error = stream_fails(&kernel).await;
    assert_eq!(error.kind, ErrorKind::Timeout);
}

#[tokio::test]
async fn a_closed_connection_is_transient_and_retried() {
    let provider = FakeProvider::start(vec![Canned::Close, completion("back", "stop")]).await;
    let response = kernel(&provider)
        .chat(ask("hi"), Context::new())
        .await
        .unwrap();
    assert_eq!(response.text(), "back");
    let provider = FakeProvider::start(vec![Canned::Close]).await;
    let kernel = Kernel::builder()
        .model(client(&provider, 5_000, 0))
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient);
}

#[tokio::test]
async fn a_length_limit_is_reported_as_such() {
    let provider = FakeProvider::start(vec![completion("It was a dark and", "length")]).await;
    let response = kernel(&provider)
        .chat(ask("a story"), Context::new())
        .await
        .unwrap();
    assert_eq!(response.finish_reason, FinishReason::LengthLimit);
}

#[tokio::test]
async fn a_stream_that_breaks_mid_answer_is_a_typed_error_and_a_hold_back_filter_leaks_nothing() {
    let mut chunks = streamed(&["Your key: ", "sk-live", "4f9a"]);
    chunks.truncate(4);
    let provider = FakeProvider::start(vec![Canned::Sse(chunks, false)]).await;
    let config = json!({ "pattern": "sk-[a-z0-9-]+", "replacement": "[KEY]", "window": 32 });
    let plugins = load(vec![spec("token_redact", "redact", config)]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(client(&provider, 5_000, 2))
        .build()
        .unwrap();
    let sink = Collector::default();
    let error: ChainError = kernel
        .chat_stream(ask("my key?"), Context::new(), sink.clone())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient);
    assert!(error.message.contains("ended before the answer"), "{error}");
    let seen = sink.tokens().concat();
    assert_eq!(
        seen, "",
        "what the filter held back is neither flushed nor leaked on a broken stream"
    );
    assert_eq!(
        provider.bodies().len(),
        1,
        "a stream that started is not retried"
    );
}

#[tokio::test]
async fn an_error_the_server_sends_inside_the_stream_ends_it_with_that_error() {
    let mut chunks = streamed(&["Hel"]);
    chunks.truncate(2);
    chunks.push(json!({ "error": { "message": "the GPU fell over", "type": "server_error" } }));
    let provider = FakeProvider::start(vec![Canned::Sse(chunks, true)]).await;
    let error = stream_fails(&kernel(&provider)).await;
    assert_eq!(error.kind, ErrorKind::Transient);
    assert!(error.message.contains("the GPU fell over"), "{error}");
}

#[tokio::test]
async fn nulls_where_a_server_means_none_read_as_none() {
    let provider = FakeProvider::start(vec![
        Canned::Json(
            200,
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "model": null,
                "choices": [{ "index": 0, "message": { "role": "assistant", "content": "hi", "tool_calls": null }, "finish_reason": "stop" }],
                "usage": { "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": null }
            }),
            vec![],
        ),
        Canned::Sse(
            vec![
                json!({ "model": null, "choices": [{ "index": 0, "delta": { "role": "assistant", "content": "o", "tool_calls": null }, "finish_reason": null }] }),
                json!({ "choices": [{ "index": 0, "delta": null, "finish_reason": null }] }),
                json!({ "choices": [{ "index": 0, "delta": { "content": "k" }, "finish_reason": "stop" }], "usage": null }),
            ],
            true,
        ),
    ])
    .await;
    let kernel = kernel(&provider);
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(
        (response.text(), response.message.tool_calls.len()),
        ("hi".to_owned(), 0)
    );
    let sink = Collector::default();
    let response = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    assert_eq!(response.text(), "ok");
    assert_eq!(response.finish_reason, FinishReason::Complete);
}

#[tokio::test]
async fn an_unreadable_chunk_ends_the_stream_with_an_error() {
    let provider = FakeProvider::start(vec![Canned::Sse(vec![json!("not a chunk")], true)]).await;
    let error = stream_fails(&kernel(&provider)).await;
    assert_eq!(error.kind, ErrorKind::Transient);
    assert!(error.message.contains("unreadable chunk"), "{error}");
}

#[tokio::test]
async fn the_timeout_also_bounds_silence_inside_a_stream() {
    let provider =
        FakeProvider::start(vec![Canned::Stall(streamed(&["Hel", "lo"])[..3].to_vec())]).await;
    // Two seconds: the head and first chunks arrive well within them on a
    // busy machine (else the stream never started, and is retried).
    let kernel = Kernel::builder()
        .model(client(&provider, 2_000, 2))
        .build()
        .unwrap();
    let sink = Collector::default();
    let error = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert!(error.message.contains("fell silent"), "{error}");
    assert_eq!(
        sink.tokens().concat(),
        "Hello",
        "what was delivered stays delivered"
    );
    assert_eq!(
        provider.bodies().len(),
        1,
        "a stream that started is not retried"
    );
}

// PEER-CASES P25
#[tokio::test]
async fn malformed_tool_call_arguments_go_back_to_the_model_as_an_error() {
    let asked = Canned::Json(
        200,
        json!({
            "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "echo", "arguments": "{\"text\": " } }]
            } }]
        }),
        vec![],
    );
    let provider = FakeProvider::start(vec![asked, completion("sorry", "stop")]).await;
    let kernel = Kernel::builder()
        .model(client(&provider, 5_000, 0))
        .builtin_tools()
        .build()
        .unwrap();
    let result = kernel
        .turn(
            TurnRequest::new(vec![Message::user("echo")]),
            Context::new(),
        )
        .await;
    let TurnResult::Done(done) = result else {
        panic!("expected a done turn, got {result:?}")
    };
    assert_eq!(done.response.text(), "sorry");
    let record = &done.tool_calls[0];
    assert_eq!(
        record.call.arguments, "{\"text\": ",
        "the raw arguments are kept"
    );
    assert_eq!(
        record.error.as_ref().unwrap().kind,
        ErrorKind::InvalidRequest
    );
    let told: Value = serde_json::from_str(
        provider.bodies()[1]["messages"][2]["content"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(told["error"]["type"], "tool_error");
    assert_eq!(told["error"]["kind"], "invalid-request");
}

/// The error a streamed chat ends with.
async fn stream_fails(kernel: &Kernel) -> ChainError {
    kernel
        .chat_stream(ask("hi"), Context::new(), Collector::default())
        .await
        .unwrap_err()
}

/// A streamed chat's answer and the tokens its sink was given.
async fn streamed_and_said(kernel: &Kernel) -> (String, String) {
    let sink = Collector::default();
    let response = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    (response.text(), sink.tokens().concat())
}

/// The bytes of an event stream with these `data:` payloads and `[DONE]`.
fn sse_bytes(chunks: &[Value]) -> Vec<u8> {
    let mut bytes: Vec<u8> = chunks
        .iter()
        .flat_map(|c| format!("data: {c}\n\n").into_bytes())
        .collect();
    bytes.extend_from_slice(b"data: [DONE]\n\n");
    bytes
}

#[tokio::test]
async fn a_byte_order_mark_and_empty_events_are_no_trouble() {
    let mut bytes = b"\xEF\xBB\xBF: keep-alive\n\ndata:\n\n".to_vec();
    bytes.extend(sse_bytes(&streamed(&["Hel", "lo"])));
    let provider = FakeProvider::start(vec![Canned::Raw(bytes)]).await;
    assert_eq!(
        streamed_and_said(&kernel(&provider)).await,
        ("Hello".into(), "Hello".into())
    );
}

#[tokio::test]
async fn a_byte_that_is_not_utf8_ends_the_stream_at_once_not_at_the_timeout() {
    let mut bytes = sse_bytes(&streamed(&["Hel"])[..2]);
    bytes.truncate(bytes.len() - b"data: [DONE]\n\n".len());
    bytes.extend_from_slice(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\xFF\"}}]}\n\n",
    );
    let provider = FakeProvider::start(vec![Canned::Raw(bytes)]).await;
    let model = client(&provider, 60_000, 0);
    let kernel = Kernel::builder().model(model).build().unwrap();
    let error = stream_fails(&kernel).await;
    assert_eq!(
        error.kind,
        ErrorKind::Transient,
        "refused as it came, not when the silence ran out: {error}"
    );
    assert!(error.message.contains("not UTF-8"), "{error}");
}

#[tokio::test]
async fn only_the_first_of_n_answers_is_read_and_a_refusal_is_one() {
    let chunk = |choices: Value| json!({ "choices": choices });
    let provider = FakeProvider::start(vec![
        Canned::Sse(
            vec![
                chunk(json!([
                    { "index": 0, "delta": { "role": "assistant", "content": "A" } },
                    { "index": 1, "delta": { "role": "assistant", "content": "B" } }
                ])),
                chunk(json!([{ "index": 1, "delta": { "content": "b" } }])),
                chunk(json!([{ "index": 0, "delta": { "content": "a" }, "finish_reason": "stop" }])),
            ],
            true,
        ),
        Canned::Sse(
            vec![
                chunk(json!([{ "index": 0, "delta": { "role": "assistant", "refusal": "I can't help with that." } }])),
                chunk(json!([{ "index": 0, "delta": {}, "finish_reason": "stop" }])),
            ],
            true,
        ),
        Canned::Json(
            200,
            json!({ "model": "m", "choices": [{ "index": 0, "message": { "role": "assistant", "content": null, "refusal": "No." }, "finish_reason": "stop" }] }),
            vec![],
        ),
    ])
    .await;
    let kernel = kernel(&provider);
    assert_eq!(streamed_and_said(&kernel).await, ("Aa".into(), "Aa".into()));
    let response = kernel
        .chat_stream(ask("hi"), Context::new(), Collector::default())
        .await
        .unwrap();
    assert_eq!(response.text(), "I can't help with that.");
    assert_eq!(response.finish_reason, FinishReason::Refusal);
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(
        (response.text(), response.finish_reason),
        ("No.".to_owned(), FinishReason::Refusal)
    );
}

#[tokio::test]
async fn tool_call_pieces_without_an_index_are_told_apart_by_their_ids() {
    let piece = |call: Value, finish: Option<&str>| json!({ "choices": [{ "index": 0, "delta": { "tool_calls": [call] }, "finish_reason": finish }] });
    let provider = FakeProvider::start(vec![Canned::Sse(
        vec![
            piece(json!({ "id": "a", "type": "function", "function": { "name": "f", "arguments": "{\"x\":" } }), None),
            piece(json!({ "function": { "arguments": "1}" } }), None),
            piece(json!({ "id": "b", "type": "function", "function": { "name": "g", "arguments": "{}" } }), Some("tool_calls")),
        ],
        true,
    )])
    .await;
    let response = kernel(&provider)
        .chat_stream(ask("hi"), Context::new(), Collector::default())
        .await
        .unwrap();
    let calls: Vec<(&str, &str, &str)> = response
        .message
        .tool_calls
        .iter()
        .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
        .collect();
    assert_eq!(calls, [("a", "f", "{\"x\":1}"), ("b", "g", "{}")]);
}

#[tokio::test]
async fn an_error_sent_with_a_200_is_an_error_and_a_whole_answer_to_a_stream_is_read() {
    let provider = FakeProvider::start(vec![
        Canned::Json(200, json!({ "error": { "message": "quota gone" } }), vec![]),
        completion("whole", "stop"),
    ])
    .await;
    let model = client(&provider, 5_000, 0);
    let kernel = Kernel::builder().model(model).build().unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert!(error.message.contains("quota gone"), "{error}");
    assert_eq!(
        streamed_and_said(&kernel).await,
        ("whole".into(), "whole".into())
    );
}

#[tokio::test]
async fn a_whole_answer_over_the_cap_is_refused_before_it_is_read() {
    let huge = "a".repeat(33 << 20);
    let provider = FakeProvider::start(vec![completion(&huge, "stop")]).await;
    // The model itself, without the kernel's check of what it returns.
    let error = shallot::ChatModel::chat(&client(&provider, 5_000, 0), &ask("hi"), &Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("over"), "{error}");
}

#[tokio::test]
async fn retry_after_in_milliseconds_or_as_a_date_and_a_408_are_retried() {
    let past =
        httpdate::fmt_http_date(std::time::SystemTime::now() - std::time::Duration::from_secs(60));
    let provider = FakeProvider::start(vec![
        asking_to_wait(429, "slow", ("retry-after-ms", "10".into())),
        asking_to_wait(503, "busy", ("retry-after", past)),
        asking_to_wait(408, "late", ("retry-after", "0".into())),
        completion("fine", "stop"),
    ])
    .await;
    let model = client(&provider, 5_000, 3);
    let kernel = Kernel::builder().model(model).build().unwrap();
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(response.text(), "fine");
    assert_eq!(provider.bodies().len(), 4, "each failure was retried");
}

// PEER-CASES P1, P3, P4, P5
/// P1: an empty answer's defaults; P3–P5: whether an answer calls tools,
/// is complete, or needs a tool call.
#[test]
fn an_answers_defaults_and_what_it_asks_for() {
    use shallot::types::{ChatResponse, ToolCall, Usage};
    let empty = ChatResponse::default();
    assert_eq!(empty.message.content, None);
    assert!(empty.message.tool_calls.is_empty());
    assert_eq!(empty.finish_reason, FinishReason::Unknown);
    assert_eq!(empty.usage, Usage::default());
    assert!(empty.model.is_empty() && empty.metadata.is_empty());
    assert!(!empty.has_tool_calls() && !empty.is_complete() && !empty.needs_tool_call());

    let done = ChatResponse::new(Message::assistant("hi"), FinishReason::Complete);
    assert!(done.is_complete() && !done.needs_tool_call());
    let stopped = ChatResponse::new(Message::assistant(""), FinishReason::ToolUse);
    assert!(stopped.needs_tool_call() && !stopped.has_tool_calls());
    let call = ToolCall {
        id: "1".into(),
        name: "add".into(),
        arguments: "{}".into(),
    };
    let calling = ChatResponse::new(
        Message {
            tool_calls: vec![call],
            ..Message::assistant("")
        },
        FinishReason::Unknown,
    );
    assert!(calling.has_tool_calls() && calling.needs_tool_call());
}
