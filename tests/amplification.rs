//! Host memory a guest could multiply: JSON text it hands the host (a
//! request's options, a context value, a tool's parameters) takes many
//! times its size once parsed, and text the gateway sends as JSON takes up
//! to six times its size once escaped. Measured by the process's peak
//! resident memory, so this runs alone in its own test binary, one test.

use serde_json::json;
use shallot::types::{ChatRequest, Message};
use shallot::{Context, ErrorKind, Gateway, GatewayConfig, Kernel, Limits, Route};
use shallot_tests::{ScriptedModel, load, resident_mib, spec};

/// Resets the process's peak (Linux: `5` to clear_refs), so that the next
/// reading is of what follows.
fn reset_peak() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    resident_mib().0
}

/// A kernel over the misbehave guest doing `action` in around-chat, with
/// `memory_mib` of linear memory and time enough for its bound to trip.
async fn misbehaving(action: &str, memory_mib: u32) -> Kernel {
    let (path, mut filter) = spec("misbehave", "bad", json!({ "on": "chat", "do": action }));
    filter.limits = Limits {
        memory_mib,
        cpu_ms: 20_000,
        wall_ms: 40_000,
        ..Limits::default()
    };
    let plugins = load(vec![(path, filter)]).await;
    Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("fine"))
        .build()
        .unwrap()
}

/// `gateway` served on a loopback port: its base URL, and what stops it
/// (awaited, once it has stopped).
async fn serving(gateway: Gateway) -> (String, impl std::future::Future<Output = ()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        gateway
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
    });
    let stop = async move {
        let _ = stop.send(());
        served.await.unwrap().unwrap();
    };
    (base, stop)
}

/// One test, so that the peaks are measured apart.
#[tokio::test]
async fn what_a_guest_could_multiply_is_bounded() {
    // First: what the others leave mapped would hide what it takes.
    request_bodies_take_their_memory_before_they_are_parsed().await;
    json_a_guest_hands_the_host_is_bounded_before_it_is_built().await;
    an_answer_that_grows_when_escaped_is_streamed_not_held().await;
    an_in_process_namespace_holds_about_what_it_is_charged().await;
}

/// Eight concurrent bodies of 4 MiB of tiny messages held 270-600 MiB
/// once parsed, before any took a place (143 MiB more at the peak here).
/// Each now takes what parsing it could build from the gateway's memory
/// for requests first, on every API: past all of it, `413` before
/// anything is built (8 MiB); bodies of long texts weigh about their size
/// and are served together; 4 MiB of tiny embedding inputs, under the
/// bound, are parsed one at a time, so together they stay within it.
async fn request_bodies_take_their_memory_before_they_are_parsed() {
    const MEMORY_MIB: u64 = 256;
    let config = GatewayConfig {
        max_request_memory: (MEMORY_MIB as usize) << 20,
        ..GatewayConfig::default()
    };
    let kernel = Kernel::builder()
        .model(ScriptedModel::answer("fine"))
        .build()
        .unwrap();
    let gateway = Gateway::new(vec![Route::proxy("scripted", kernel)], config);
    let (base, stop) = serving(gateway).await;
    let tiny = json!({ "role": "user", "content": "x" });
    let long = json!({ "role": "user", "content": "y".repeat(1 << 20) });
    let chat = |message: &serde_json::Value, n: usize| json!({ "model": "scripted", "messages": vec![message; n] });
    let responses = json!({ "model": "scripted", "input": vec![&tiny; 130_000] });
    let mut messages = chat(&tiny, 130_000);
    messages["max_tokens"] = json!(16);
    let inputs = json!({ "model": "scripted", "input": vec!["x"; 1_000_000] });
    let cases = [
        ("chat/completions", chat(&tiny, 130_000), 413, 64),
        ("chat/completions", chat(&long, 3), 200, 64),
        ("responses", responses, 413, 64),
        ("messages", messages, 413, 64),
        ("embeddings", inputs, 404, MEMORY_MIB),
    ];
    for (path, body, status, bound) in cases {
        let body = bytes::Bytes::from(body.to_string());
        let url = format!("{base}/v1/{path}");
        let before = reset_peak();
        let client = reqwest::Client::new();
        let sent = (0..8).map(|_| client.post(&url).body(body.clone()).send());
        for answer in futures::future::join_all(sent).await {
            let answer = answer.unwrap();
            assert_eq!(answer.status().as_u16(), status, "{path}");
            if status == 413 {
                let said: serde_json::Value = answer.json().await.unwrap();
                let error = &said["error"];
                let code = if path == "messages" {
                    &error["type"]
                } else {
                    &error["code"]
                };
                assert_eq!(code, "request_too_large", "{said}");
            }
        }
        let (_, peak) = resident_mib();
        let grown = peak.saturating_sub(before);
        eprintln!(
            "{path}: eight bodies of {} KiB, {status}: the peak grew {grown} MiB",
            body.len() >> 10
        );
        assert!(
            grown < bound,
            "{path}: eight bodies of {} KiB grew the peak by {grown} MiB",
            body.len() >> 10,
        );
    }
    stop.await;
}

/// The in-process key store charges an entry what it costs the host, its
/// slot in the map as well as its key and value, and gives back a
/// flood's room once its keys are gone: tiny keys written until the
/// namespace is full held 77 MiB for a cap of 16, and held it after they
/// were deleted. Each round here fills the namespace with keys of its own
/// and deletes them; the peak stays near the cap.
async fn an_in_process_namespace_holds_about_what_it_is_charged() {
    let store = shallot::open_kv(":memory:amplification").await.unwrap();
    let cap_mib = (shallot::NAMESPACE_CAP >> 20) as u64;
    let before = reset_peak();
    for round in 0..3 {
        let mut written = Vec::new();
        loop {
            let key = format!("r{round}-{}", written.len());
            match store.set("flood", None, &key, "", None).await {
                Ok(_) => written.push(key),
                Err(e) => {
                    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
                    break;
                }
            }
        }
        assert!(written.len() > 10_000, "{} keys", written.len());
        for key in &written {
            store.delete("flood", key).await.unwrap();
        }
    }
    let (_, peak) = resident_mib();
    assert!(
        peak - before < 2 * cap_mib,
        "three floods of a namespace capped at {cap_mib} MiB grew the peak by {} MiB",
        peak - before
    );
}

/// 40 MiB of JSON holding 20 million values would be more than 600 MiB as
/// the host's values, and so would thirty tools' parameters of 1.3 MiB
/// each (each under the cap alone): the host walks the text first and
/// faults the filter before building any, so its peak stays near the
/// text's own size.
async fn json_a_guest_hands_the_host_is_bounded_before_it_is_built() {
    for action in ["json-bomb", "tools-bomb"] {
        let kernel = misbehaving(action, 64).await;
        let before = reset_peak();
        let request = ChatRequest::new(vec![Message::user("hi")]);
        let error = kernel.chat(request, Context::new()).await.unwrap_err();
        let (_, peak) = resident_mib();
        assert_eq!(error.kind, ErrorKind::PluginFault, "{action}: {error}");
        assert!(error.message.contains("host memory"), "{action}: {error}");
        assert!(
            peak - before < 300,
            "{action}: the peak grew by {} MiB for about 40 MiB of text",
            peak - before
        );
    }
}

/// A filter answering 48 MiB of control characters, served as JSON and as
/// a stream, in each client API: escaped at once, that answer is 288 MiB
/// (the gateway held 268 MiB more than the answer for it). The gateway
/// writes the JSON as it sends it, and cuts stream events into pieces, so
/// its peak stays near the answer's copies: the guest's two in its linear
/// memory (the text it built and the message made of it) and the host's
/// one, which is what is shown (where no filter transforms tokens, the
/// delivered text is the answer's own, moved: it was copied, and the peak
/// was 236-240 MiB where it is now 188-192). The Responses API's closing
/// events repeat the whole text, as OpenAI's protocol has them: each is
/// written around the one copy of it, escaped as it is sent, like the JSON
/// answers.
async fn an_answer_that_grows_when_escaped_is_streamed_not_held() {
    let kernel = misbehaving("escaped-answer", 256).await;
    let gateway = Gateway::new(vec![Route::proxy("m", kernel)], GatewayConfig::default());
    let (base, stop) = serving(gateway).await;
    let messages = json!([{ "role": "user", "content": "hi" }]);
    let apis = [
        (
            "/v1/chat/completions",
            json!({ "model": "m", "messages": messages }),
        ),
        (
            "/v1/messages",
            json!({ "model": "m", "max_tokens": 16, "messages": messages }),
        ),
        ("/v1/responses", json!({ "model": "m", "input": "hi" })),
    ];
    for (path, request) in apis {
        for stream in [false, true] {
            let before = reset_peak();
            let mut request = request.clone();
            request["stream"] = json!(stream);
            let mut response = reqwest::Client::new()
                .post(format!("{base}{path}"))
                .json(&request)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{path}, stream: {stream}");
            let mut received = 0usize;
            while let Some(chunk) = response.chunk().await.unwrap() {
                received += chunk.len();
            }
            let (_, peak) = resident_mib();
            assert!(
                received > 6 * (48 << 20),
                "{path}: the whole answer came: {received} bytes"
            );
            assert!(
                peak - before < 224,
                "{path}, stream: {stream}: the peak grew by {} MiB for a 48 MiB answer",
                peak - before
            );
        }
    }
    stop.await;
}
