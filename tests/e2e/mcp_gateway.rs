//! The gateway as an MCP server (`POST /mcp`), driven by the official
//! Python MCP client (`tests/mcp/client.py`) and by hand-made hostile
//! requests: the `[[mcp]]` servers' tools federated into one list, trimmed
//! per key; every `tools/call` through the endpoint's filters (a Rust
//! `tool-guard` refusing, a Python filter rewriting the arguments, a token
//! transform redacting the shown result) before the server; a client that
//! sends garbage, comes from another host, opens too many sessions, calls
//! a tool it was not given or one that never ends: each a clear error
//! within its bound, the endpoint serving on.
//!
//! Needs the `mcp` package in the polyglot venv and the Python filters:
//! `scripts/build-polyglot`.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::ToolSpec;
use shallot::{Gateway, GatewayConfig, Kernel, McpEndpoint, Serving};
use shallot_tests::{guest, load, mcp_python, mcp_script, mcp_test_server, target_dir};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

use crate::gateway::{Served, answer_of, read_until_closed};

/// `ops-secret` may list and call every tool; `reader-secret` only
/// `test_echo`, `test_add` and `test_hang`, and `tool-guard` takes
/// `test_add` off its menu and refuses it the call (and the prompt
/// `test_plain`); it reads only the public notes and the rooms.
const OPS: &str = "32323cfa9ec9d62750daad0836a4cf3d7b60d23723b7852a529667deed01669f";
const READER: &str = "f03319dee240faa729e0cfa7ab5ffd80a1d64a127e3643f239009abff6382914";

/// A gateway serving `/mcp` over the test server, with the filters and
/// keys above, and `more` TOML for `[mcp_gateway]`; and the gateway, to
/// swap what it serves.
async fn endpoint(name: &str, more: &str, config: GatewayConfig) -> (Served, Gateway) {
    let dir = target_dir().join("test-scratch").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let server = mcp_script("server.py");
    let toml = format!(
        "[[filter]]\nname = \"guard\"\nplugin = {guard:?}\n\
         config = {{ by = \"key\", deny = {{ reader = [\"test_add\", \"test_plain\"] }} }}\n\n\
         [[filter]]\nname = \"pii\"\nplugin = {pii:?}\n\n\
         [[filter]]\nname = \"redact\"\nplugin = {redact:?}\n\
         config = {{ pattern = \"SECRET-\\\\d+\", replacement = \"[SECRET]\" }}\n\n\
         [[key]]\nname = \"ops\"\nsha256 = \"{OPS}\"\n\n\
         [[key]]\nname = \"reader\"\nsha256 = \"{READER}\"\n\
         tools = [\"test_echo\", \"test_add\", \"test_ha*\"]\n\
         prompts = [\"test_*\"]\n\
         resources = [\"test://notes/public\", \"test://rooms/*\"]\n\n\
         [[mcp]]\nname = \"test\"\ncommand = {python:?}\nargs = [{server:?}]\n\n\
         [mcp_gateway]\n{more}\n",
        guard = guest("tool_guard").display().to_string(),
        pii = guest("pii_guard_py").display().to_string(),
        redact = guest("token_redact").display().to_string(),
        python = mcp_python().display().to_string(),
        server = server.display().to_string(),
    );
    std::fs::write(&file, toml).unwrap();
    let config_file = shallot::Config::read(&file).unwrap();
    let plugins = load(config_file.filters().unwrap()).await;
    let serving = Serving::from_config(Some(&config_file), &plugins, None)
        .await
        .unwrap();
    let gateway = Gateway::new(serving.routes, config);
    gateway.set_keys(serving.keys);
    gateway.set_mcp(serving.mcp);
    (Served::gateway(gateway.clone()).await, gateway)
}

/// What the Python client says of `args` against `served`'s `/mcp`.
async fn client(served: &Served, key: &str, args: &[&str]) -> Value {
    let url = format!("{}/mcp", served.base);
    let out = tokio::process::Command::new(mcp_python())
        .arg(mcp_script("client.py"))
        .args([url.as_str(), key])
        .args(args)
        .output()
        .await
        .expect("the venv's Python runs (scripts/build-polyglot)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Prompts, resources and templates are federated, each key seeing the
/// ones its patterns match; a `prompts/get` and a `resources/read` pass
/// the filters as tool calls do: `tool-guard` refuses a prompt by name,
/// and the redaction holds on a prompt's messages and a resource's text.
#[tokio::test]
async fn prompts_and_resources_are_federated_per_key_through_the_filters() {
    let (served, _) = endpoint("mcp-gateway-offers", "", GatewayConfig::default()).await;
    let every = client(&served, "ops-secret", &["offers"]).await;
    assert_eq!(
        every["prompts"],
        json!(["test_greet", "test_plain"]),
        "{every}"
    );
    assert_eq!(
        every["resources"],
        json!(["test://notes/private", "test://notes/public"])
    );
    assert_eq!(every["templates"], json!(["test://rooms/{room}"]));
    let given = client(&served, "reader-secret", &["offers"]).await;
    assert_eq!(
        given["resources"],
        json!(["test://notes/public"]),
        "{given}"
    );
    assert_eq!(given["templates"], json!(["test://rooms/{room}"]));

    let greeted = client(
        &served,
        "reader-secret",
        &["prompt", "test_greet", r#"{"name": "Ada"}"#],
    )
    .await;
    assert_eq!(
        greeted["messages"],
        json!(["Hello Ada, your code is [SECRET]"]),
        "{greeted}"
    );
    let refused = client(&served, "reader-secret", &["prompt", "test_plain", "{}"]).await;
    let said = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("test_plain"),
        "tool-guard refuses it: {refused}"
    );
    let plain = client(&served, "ops-secret", &["prompt", "test_plain", "{}"]).await;
    assert_eq!(plain["messages"], json!(["plain words"]), "{plain}");

    let read = client(&served, "reader-secret", &["read", "test://notes/public"]).await;
    assert_eq!(
        read["contents"],
        json!(["the door code is [SECRET]"]),
        "{read}"
    );
    let room = client(&served, "reader-secret", &["read", "test://rooms/kitchen"]).await;
    assert_eq!(room["contents"], json!(["room kitchen"]), "{room}");
    let hidden = client(&served, "reader-secret", &["read", "test://notes/private"]).await;
    assert!(
        hidden["error"]["message"].is_string(),
        "not the key's: {hidden}"
    );
    let private = client(&served, "ops-secret", &["read", "test://notes/private"]).await;
    assert_eq!(private["contents"], json!(["private"]), "{private}");
    let nowhere = client(&served, "ops-secret", &["read", "test://nowhere"]).await;
    assert!(nowhere["error"]["message"].is_string(), "{nowhere}");
}

/// A session subscribed to a resource hears that it was updated (and not
/// of another resource); a session may subscribe to at most 64, and only
/// to resources its key may read.
#[tokio::test]
async fn a_subscribed_session_hears_its_resource_was_updated_within_its_bounds() {
    let (served, _) = endpoint("mcp-gateway-subscribe", "", GatewayConfig::default()).await;
    let heard = client(&served, "ops-secret", &["subscribe", "test://notes/public"]).await;
    assert_eq!(heard, json!({ "updated": "test://notes/public" }));
    let many = client(&served, "ops-secret", &["subscribe-many", "64"]).await;
    assert_eq!(many, json!({ "subscribed": 64 }));
    let over = client(&served, "ops-secret", &["subscribe-many", "65"]).await;
    let said = over["error"]["message"].as_str().unwrap_or_default();
    assert!(said.contains("at most 64"), "{over}");
    let hidden = client(
        &served,
        "reader-secret",
        &["subscribe", "test://notes/private"],
    )
    .await;
    assert!(
        hidden["error"]["message"].is_string(),
        "not the key's: {hidden}"
    );
}

/// A server that asks for a model's answer during a call
/// (`sampling/createMessage`) is answered by the `/mcp` client that made
/// the call, when that client said it answers sampling, what it is asked
/// shown through the redaction first; a client that did not is never
/// answered for: the server hears no one can.
#[tokio::test]
async fn a_servers_sampling_during_a_call_is_answered_by_that_calls_client() {
    let (served, _) = endpoint("mcp-gateway-sampling", "", GatewayConfig::default()).await;
    let asked = json!({ "prompt": "a haiku about SECRET-77" }).to_string();
    let answered = client(&served, "ops-secret", &["sample", "test_ask_model", &asked]).await;
    assert_eq!(answered["is_error"], false, "{answered}");
    let text = answered["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("the model said: echo of a haiku about [SECRET]"),
        "{answered}"
    );
    let unasked = call(
        &served,
        "ops-secret",
        "test_ask_model",
        json!({ "prompt": "a haiku" }),
    )
    .await;
    assert_eq!(unasked["is_error"], true, "{unasked}");
    let said = unasked["text"].as_str().unwrap_or_default();
    assert!(
        said.contains("the client of this call does not answer sampling"),
        "{unasked}"
    );
}

/// What a server logs during a call reaches the client of that call, at
/// or above the level that client set, redacted as every text shown.
#[tokio::test]
async fn a_servers_log_lines_during_a_call_reach_that_calls_client_at_its_level() {
    let (served, _) = endpoint("mcp-gateway-logs", "", GatewayConfig::default()).await;
    let every = client(&served, "ops-secret", &["logs", "test_chatty", "-"]).await;
    assert_eq!(
        every["heard"],
        json!([
            { "level": "info", "data": "starting with [SECRET]" },
            { "level": "error", "data": "failed with [SECRET]" },
        ]),
        "{every}"
    );
    let errors = client(&served, "ops-secret", &["logs", "test_chatty", "error"]).await;
    assert_eq!(
        errors["heard"],
        json!([{ "level": "error", "data": "failed with [SECRET]" }]),
        "{errors}"
    );
}

async fn call(served: &Served, key: &str, tool: &str, arguments: Value) -> Value {
    let arguments = arguments.to_string();
    client(served, key, &["call", tool, &arguments]).await
}

#[tokio::test]
async fn the_python_mcp_client_sees_its_keys_tools_and_every_call_goes_through_the_filters() {
    let (served, _) = endpoint("mcp-gateway", "", GatewayConfig::default()).await;

    let every = client(&served, "ops-secret", &["list"]).await;
    for tool in [
        "test_add",
        "test_echo",
        "test_fail",
        "test_hang",
        "test_grow",
    ] {
        assert!(every.as_array().unwrap().contains(&json!(tool)), "{every}");
    }
    // The key's tools, less what a filter takes off the menu.
    let given = client(&served, "reader-secret", &["list"]).await;
    assert_eq!(given, json!(["test_echo", "test_hang"]));

    // Through the chain to the server and back, structured.
    let added = call(
        &served,
        "ops-secret",
        "test_add",
        json!({ "a": 2, "b": 40 }),
    )
    .await;
    assert_eq!(added["structured"], json!({ "result": 42 }), "{added}");
    assert_eq!(added["is_error"], false);

    // Called anyway, tool-guard refuses it: the server never sees it.
    let refused = call(
        &served,
        "reader-secret",
        "test_add",
        json!({ "a": 1, "b": 1 }),
    )
    .await;
    assert_eq!(refused["is_error"], true, "{refused}");
    assert!(
        refused["text"].as_str().unwrap().contains("not_allowed"),
        "{refused}"
    );

    // The Python filter rewrites the arguments: the server echoes what it
    // got.
    let echoed = call(
        &served,
        "reader-secret",
        "test_echo",
        json!({ "text": "mail jane@example.com" }),
    )
    .await;
    assert_eq!(echoed["structured"]["result"], "mail [EMAIL]", "{echoed}");

    // What the client is shown goes through the token transforms.
    let shown = call(
        &served,
        "ops-secret",
        "test_echo",
        json!({ "text": "SECRET-42" }),
    )
    .await;
    assert_eq!(shown["text"], r#"{"result":"[SECRET]"}"#, "{shown}");
    assert_eq!(shown["structured"]["result"], "[SECRET]", "{shown}");

    // A tool the key was not given does not exist for it.
    let hidden = call(&served, "reader-secret", "test_fail", json!({ "why": "x" })).await;
    assert_eq!(hidden["error"]["code"], -32602, "{hidden}");
    assert_eq!(hidden["error"]["message"], "unknown tool 'test_fail'");

    // The server's own failure is the tool's error result.
    let failed = call(
        &served,
        "ops-secret",
        "test_fail",
        json!({ "why": "no luck" }),
    )
    .await;
    assert_eq!(failed["is_error"], true, "{failed}");
    assert!(
        failed["text"].as_str().unwrap().contains("no luck"),
        "{failed}"
    );

    // Arguments the server's schema refuses are refused before they leave.
    let wrong = call(&served, "ops-secret", "test_add", json!({ "a": "two" })).await;
    assert_eq!(wrong["is_error"], true, "{wrong}");
    assert!(
        wrong["text"]
            .as_str()
            .unwrap()
            .contains("do not match its schema"),
        "{wrong}"
    );

    // Without a key, or with a wrong one: refused, saying why.
    let nobody = client(&served, "-", &["list"]).await;
    assert!(
        nobody["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no API key"),
        "{nobody}"
    );
    let stranger = client(&served, "guess", &["list"]).await;
    assert_eq!(stranger["error"]["message"], "the API key is not valid");

    let (_, ready) = served.get("/readyz").await;
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["mcp"]["filters"], json!(["guard", "pii", "redact"]));
    assert!(
        ready["mcp"]["tools"]
            .as_array()
            .unwrap()
            .contains(&json!("test_echo")),
        "{ready}"
    );
    let (_, metrics) = served.get("/metrics").await;
    assert!(
        metrics.contains(r#"shallot_gateway_mcp_calls_total{tool="test_add",outcome="ok"} 1"#),
        "{metrics}"
    );
    served.stop().await.unwrap();
}

/// The Python client watching `served`'s tools (`watch` or
/// `watch-legacy`), and its lines as they come.
async fn watching(served: &Served, mode: &str) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = tokio::process::Command::new(mcp_python())
        .arg(mcp_script("client.py"))
        .args([&format!("{}/mcp", served.base), "ops-secret", mode])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the venv's Python runs (scripts/build-polyglot)");
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// The next line a watching client prints.
async fn next(lines: &mut Lines<BufReader<ChildStdout>>) -> Value {
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the client says something within a minute")
        .unwrap()
        .expect("the client is still running");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// The gateway tells its clients when its tools change: one listening with
/// `subscriptions/listen` (the newest protocol) and a session of the
/// initialize handshake each list again and get the new tools. A shutdown
/// ends the listen gracefully at once, and the session's stream too,
/// rather than holding them to the end of a drain longer than the test.
#[tokio::test]
async fn clients_are_told_when_the_tools_change_and_a_shutdown_ends_their_streams() {
    let config = GatewayConfig {
        drain_timeout: Duration::from_secs(600),
        ..GatewayConfig::default()
    };
    let (served, gateway) = endpoint("mcp-told", "", config).await;
    let (_listener, mut listened) = watching(&served, "watch").await;
    let (mut session, mut told) = watching(&served, "watch-legacy").await;
    let before = next(&mut listened).await;
    assert!(before.as_array().unwrap().contains(&json!("test_echo")));
    assert_eq!(next(&mut told).await, before);

    let clock = ToolSpec::new("clock", "What time it is", json!({ "type": "object" }));
    let builder = Kernel::builder().tool(clock, |_, _| async { Ok(json!("noon")) });
    let clock = McpEndpoint::new(builder).unwrap();
    gateway.set_mcp(Some(clock.clone()));
    assert_eq!(next(&mut listened).await, json!(["clock"]));
    // The session hears on its own stream, which its client opens after
    // the handshake: until it has, a notice is lost, so it is told again.
    let mut heard = None;
    for _ in 0..60 {
        match tokio::time::timeout(Duration::from_secs(1), told.next_line()).await {
            Ok(line) => {
                heard = line.unwrap();
                break;
            }
            Err(_) => gateway.set_mcp(Some(clock.clone())),
        }
    }
    assert_eq!(heard.as_deref(), Some(r#"["clock"]"#));

    let stopped = tokio::spawn(served.stop());
    loop {
        let line = next(&mut listened).await;
        if line != json!(["clock"]) {
            assert_eq!(line, json!({ "ended": "closed" }));
            break;
        }
    }
    tokio::time::timeout(Duration::from_secs(60), stopped)
        .await
        .expect("the gateway stops without waiting out the drain")
        .unwrap()
        .unwrap();
    session.kill().await.unwrap();
}

/// One raw request to `/mcp` with `ops-secret`: its status and body.
async fn raw(
    served: &Served,
    headers: &[(&str, &str)],
    body: impl Into<reqwest::Body>,
) -> (u16, String, reqwest::header::HeaderMap) {
    raw_as(served, "ops-secret", reqwest::Method::POST, headers, body).await
}

/// One raw request to `/mcp`, with `key`.
async fn raw_as(
    served: &Served,
    key: &str,
    method: reqwest::Method,
    headers: &[(&str, &str)],
    body: impl Into<reqwest::Body>,
) -> (u16, String, reqwest::header::HeaderMap) {
    let mut request = reqwest::Client::new()
        .request(method, format!("{}/mcp", served.base))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.body(body).send().await.unwrap();
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    (status, response.text().await.unwrap(), headers)
}

fn initialize() -> String {
    json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": { "name": "hostile", "version": "0" },
        },
    })
    .to_string()
}

/// With `sessions` in one Redis, a session of the initialize handshake
/// opened on one replica is served by another that never saw it (the SDK
/// replays its handshake there), as a load balancer without affinity
/// sends it: requests alternating between the two all answer, to the key
/// that opened it only; without the store, the other replica does not
/// know it.
#[tokio::test]
async fn a_session_opened_on_one_replica_is_served_by_another_sharing_its_store() {
    let redis = shallot_tests::RedisServer::start();
    let kept = format!("sessions = {:?}", redis.url());
    let (one, _) = endpoint("mcp-replica-one", &kept, GatewayConfig::default()).await;
    let (two, _) = endpoint("mcp-replica-two", &kept, GatewayConfig::default()).await;
    let (status, body, headers) = raw(&one, &[], initialize()).await;
    assert_eq!(status, 200, "{body}");
    let id = headers["mcp-session-id"].to_str().unwrap().to_owned();
    let session = [
        ("mcp-session-id", id.as_str()),
        ("mcp-protocol-version", "2025-06-18"),
    ];
    let initialized = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    let (status, body, _) = raw(&one, &session, initialized.to_string()).await;
    assert!((200..300).contains(&status), "{status} {body}");
    for (n, replica) in [&two, &one, &two].into_iter().enumerate() {
        let call = json!({
            "jsonrpc": "2.0", "id": 10 + n, "method": "tools/call",
            "params": { "name": "test_echo", "arguments": { "text": format!("hop {n}") } },
        });
        let (status, body, _) = raw(replica, &session, call.to_string()).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(&format!("hop {n}")), "{body}");
    }
    let listed = json!({ "jsonrpc": "2.0", "id": 20, "method": "tools/list" }).to_string();
    let (status, body, _) = raw_as(
        &two,
        "reader-secret",
        reqwest::Method::POST,
        &session,
        listed.clone(),
    )
    .await;
    assert_eq!(status, 404, "another key's session does not exist: {body}");

    let (alone, _) = endpoint("mcp-replica-alone", "", GatewayConfig::default()).await;
    let (status, body, _) = raw(&alone, &session, listed).await;
    assert_eq!(status, 404, "no store, no session: {body}");
}

#[tokio::test]
async fn hostile_clients_of_mcp_get_clear_errors_and_the_endpoint_serves_on() {
    let config = GatewayConfig {
        request_timeout: Duration::from_secs(10),
        max_body_bytes: 64 << 10,
        ..GatewayConfig::default()
    };
    let (served, _) = endpoint("mcp-hostile", "max_sessions = 2", config).await;

    // Not JSON at all.
    let (status, body, _) = raw(&served, &[], "{garbage").await;
    assert!((400..500).contains(&status), "{status} {body}");
    // JSON-RPC with no session, and with a session that does not exist.
    let list = json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/list" }).to_string();
    let (status, body, _) = raw(&served, &[], list.clone()).await;
    assert_eq!(status, 400, "{body}");
    let (status, body, _) = raw(&served, &[("mcp-session-id", "forged")], list).await;
    assert!((400..500).contains(&status), "{status} {body}");
    // From a host the endpoint does not answer (DNS rebinding).
    let (status, body, _) = raw(&served, &[("host", "evil.example")], initialize()).await;
    assert_eq!(status, 403, "{body}");
    // A body over the cap.
    let (status, _, _) = raw(&served, &[], vec![b' '; 128 << 10]).await;
    assert_eq!(status, 413);

    // Sessions up to the cap; then the next is refused until one closes.
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let (status, body, headers) = raw(&served, &[], initialize()).await;
        assert_eq!(status, 200, "{body}");
        sessions.push(headers["mcp-session-id"].to_str().unwrap().to_owned());
    }
    let (status, body, _) = raw(&served, &[], initialize()).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("too many MCP sessions"), "{body}");

    // A session answers only the key that opened it: to another key it
    // does not exist, to read, to listen to, or to close.
    let theirs = [("mcp-session-id", sessions[0].as_str())];
    let initialized = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    let (status, body, _) = raw(&served, &theirs, initialized.to_string()).await;
    assert!((200..300).contains(&status), "{status} {body}");
    let listed = json!({ "jsonrpc": "2.0", "id": 3, "method": "tools/list" }).to_string();
    for method in [
        reqwest::Method::POST,
        reqwest::Method::GET,
        reqwest::Method::DELETE,
    ] {
        let (status, body, _) = raw_as(
            &served,
            "reader-secret",
            method.clone(),
            &theirs,
            listed.clone(),
        )
        .await;
        assert_eq!(status, 404, "{method} {body}");
        assert_eq!(body, "Not Found: Session not found");
    }
    let (status, body, _) = raw(&served, &theirs, listed).await;
    assert_eq!(status, 200, "the opener's session is still open: {body}");
    assert!(body.contains("test_echo"), "{body}");
    for session in &sessions {
        let closed = reqwest::Client::new()
            .delete(format!("{}/mcp", served.base))
            .header("authorization", "Bearer ops-secret")
            .header("mcp-session-id", session)
            .send()
            .await
            .unwrap();
        assert!(closed.status().is_success(), "{}", closed.status());
    }

    // A call that never ends is cut at the request deadline, as a timeout.
    let hung = call(&served, "ops-secret", "test_hang", json!({})).await;
    assert_eq!(hung["is_error"], true, "{hung}");
    assert!(hung["text"].as_str().unwrap().contains("timeout"), "{hung}");

    // And through it all, a well-behaved client is served.
    let added = call(
        &served,
        "reader-secret",
        "test_echo",
        json!({ "text": "still here" }),
    )
    .await;
    assert_eq!(added["structured"]["result"], "still here", "{added}");
    served.stop().await.unwrap();
}

/// A message that never arrives whole is cut at the read timeout, as on
/// `/v1`: `408`, saying so, before the protocol sees any of it.
#[tokio::test]
async fn a_message_that_arrives_too_slowly_is_refused_at_the_read_timeout() {
    let config = GatewayConfig {
        read_timeout: Duration::from_millis(300),
        ..GatewayConfig::default()
    };
    let (served, _) = endpoint("mcp-slow", "", config).await;
    let address = served.base.trim_start_matches("http://");
    let mut slow = tokio::net::TcpStream::connect(address).await.unwrap();
    let head = "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer ops-secret\r\n\
                content-type: application/json\r\naccept: application/json, text/event-stream\r\n\
                content-length: 100\r\n\r\n{\"jsonrpc\"";
    slow.write_all(head.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 300 ms"), "{answer}");
    served.stop().await.unwrap();
}

/// `/mcp` is behind the bounds every API is: a request without a key is
/// refused from its head, before its message comes, as JSON-RPC writes
/// errors, and counted in `/metrics` as mode `mcp`.
#[tokio::test]
async fn a_keyless_message_is_refused_from_its_head_and_counted() {
    let config = GatewayConfig {
        read_timeout: Duration::from_secs(3600),
        ..GatewayConfig::default()
    };
    let (served, _) = endpoint("mcp-keyless", "", config).await;
    let address = served.base.trim_start_matches("http://");
    let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
    let head = "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n\
                accept: application/json, text/event-stream\r\ncontent-length: 100\r\n\r\n{";
    client.write_all(head.as_bytes()).await.unwrap();
    let (status, body) = answer_of(&mut client).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["jsonrpc"], "2.0", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("API key"),
        "{body}"
    );
    served
        .metric_reads(r#"shallot_gateway_requests_total{model="",mode="mcp",status="401"} 1"#)
        .await;
    served.stop().await.unwrap();
}

/// A `tools/list` runs the chat filters, so it takes a place among the
/// requests served at once as a call does: with the one place held by a
/// call that hangs, a listing is refused, saying so; once the call is cut
/// at the deadline, the listing is served.
#[tokio::test]
async fn a_listing_a_subscription_and_a_completion_take_a_place_as_a_call_does() {
    let config = GatewayConfig {
        max_concurrent: 1,
        max_queued: 0,
        request_timeout: Duration::from_secs(10),
        ..GatewayConfig::default()
    };
    let (served, _) = endpoint("mcp-listing-place", "", config).await;
    let (status, body, headers) = raw(&served, &[], initialize()).await;
    assert_eq!(status, 200, "{body}");
    let session = headers["mcp-session-id"].to_str().unwrap().to_owned();
    let ours = [("mcp-session-id", session.as_str())];
    let initialized = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    raw(&served, &ours, initialized.to_string()).await;
    let listed = json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/list" }).to_string();

    // A subscription and a completion ask a server: they take a place too.
    let subscribe = json!({
        "jsonrpc": "2.0", "id": 3, "method": "resources/subscribe",
        "params": { "uri": "test://notes/public" },
    });
    let complete = json!({
        "jsonrpc": "2.0", "id": 4, "method": "completion/complete",
        "params": {
            "ref": { "type": "ref/prompt", "name": "test_greet" },
            "argument": { "name": "name", "value": "A" },
        },
    });
    let hung = call(&served, "ops-secret", "test_hang", json!({}));
    let refused = async {
        served
            .metric_reads("shallot_gateway_requests_in_progress 1")
            .await;
        let mut answers = Vec::new();
        for asked in [listed.clone(), subscribe.to_string(), complete.to_string()] {
            answers.push(raw(&served, &ours, asked).await);
        }
        answers
    };
    let (hung, answers) = tokio::join!(hung, refused);
    for (status, body, _) in &answers {
        assert!(body.contains("requests are in progress"), "{status} {body}");
    }
    assert!(!answers[0].1.contains("test_echo"), "{}", answers[0].1);
    assert!(hung["text"].as_str().unwrap().contains("timeout"), "{hung}");

    let (status, body, _) = raw(&served, &ours, listed).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("test_echo"), "{body}");
    served.stop().await.unwrap();
}

/// A server that adds a tool says so; the host lists its tools again, and
/// a kernel built after has it. A flood of such notices with nothing
/// changed changes nothing.
#[tokio::test]
async fn a_server_that_says_its_tools_changed_is_listed_again() {
    let config = mcp_test_server(10_000);
    let server = shallot::McpServer::start(config).await.unwrap();
    assert_eq!(server.changes(), 0);
    let kernel = shallot::Kernel::builder().mcp(&server).build().unwrap();
    let churned = kernel
        .tool(
            "test_churn",
            json!({ "times": 500 }),
            shallot::Context::new(),
        )
        .await
        .unwrap();
    assert_eq!(churned.value().unwrap(), json!({ "result": "churned" }));
    let grown = kernel
        .tool(
            "test_grow",
            json!({ "name": "late" }),
            shallot::Context::new(),
        )
        .await
        .unwrap();
    assert_eq!(grown.value().unwrap(), json!({ "result": "added late" }));
    // Had the churn counted as a change, this would not wait for the tool.
    tokio::time::timeout(Duration::from_secs(30), server.changed(0))
        .await
        .expect("the new list arrives");
    assert!(server.tools().iter().any(|t| t.name == "test_late"));
    assert!(
        !kernel.tools().iter().any(|t| t.name == "test_late"),
        "a kernel built before keeps the list it was built with"
    );
    let rebuilt = shallot::Kernel::builder().mcp(&server).build().unwrap();
    let late = rebuilt
        .tool("test_late", json!({}), shallot::Context::new())
        .await
        .unwrap();
    assert_eq!(late.value().unwrap(), json!({ "result": "I am late" }));
}

/// A call that asks for its progress hears what the server reports,
/// growing, through the gateway: its numbers, not its words (which would
/// reach the client without passing the token transforms). A server that
/// floods its reports is answered all the same, the client hearing no
/// more than it was sent, growing; a call that does not ask hears none.
/// (A report that comes with the answer may be lost: the SDK hands each
/// notification to a task of its own, so none is asserted but that some
/// come.)
#[tokio::test]
async fn a_call_that_asks_for_its_progress_hears_what_the_server_reports() {
    let (served, _) = endpoint("mcp-progress", "", GatewayConfig::default()).await;
    let asked = ["progress", "test_report", r#"{"times": 3, "pause_ms": 50}"#];
    let reported = client(&served, "ops-secret", &asked).await;
    assert_eq!(reported["structured"]["result"], "reported 3", "{reported}");
    let heard: Vec<f64> = reported["progress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|report| {
            assert_eq!(report["total"], 3.0, "{reported}");
            assert_eq!(report["message"], Value::Null, "the words stay out");
            report["progress"].as_f64().unwrap()
        })
        .collect();
    assert!(!heard.is_empty(), "{reported}");
    assert!(
        heard.iter().all(|n| [1.0, 2.0, 3.0].contains(n)),
        "{heard:?}"
    );
    assert!(heard.windows(2).all(|w| w[0] < w[1]), "growing: {heard:?}");

    let flood = ["progress", "test_report", r#"{"times": 5000}"#];
    let flooded = client(&served, "ops-secret", &flood).await;
    assert_eq!(flooded["structured"]["result"], "reported 5000");
    let heard: Vec<f64> = flooded["progress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|report| report["progress"].as_f64().unwrap())
        .collect();
    assert!(!heard.is_empty() && heard.len() <= 5000, "{}", heard.len());
    assert!(heard.windows(2).all(|w| w[0] < w[1]), "growing: {heard:?}");

    let quiet = call(&served, "ops-secret", "test_report", json!({ "times": 3 })).await;
    assert_eq!(quiet["structured"]["result"], "reported 3");
    assert_eq!(quiet.get("progress"), None);
    served.stop().await.unwrap();
}

/// A call the gateway gives up on (at the request deadline) is cancelled at
/// the server too (`notifications/cancelled`), whether or not it asked for
/// its progress: the server's tool hears it and stops.
#[tokio::test]
async fn a_call_cut_at_the_deadline_is_cancelled_at_the_server() {
    let config = GatewayConfig {
        request_timeout: Duration::from_secs(2),
        ..GatewayConfig::default()
    };
    let (served, _) = endpoint("mcp-cancelled", "", config).await;
    let dir = target_dir().join("test-scratch").join("mcp-cancelled");
    for how in ["call", "progress"] {
        let told = dir.join(format!("{how}.told"));
        let _ = std::fs::remove_file(&told);
        let arguments = json!({ "path": told.display().to_string() }).to_string();
        let cut = client(&served, "ops-secret", &[how, "test_linger", &arguments]).await;
        assert_eq!(cut["is_error"], true, "{cut}");
        assert!(cut["text"].as_str().unwrap().contains("timeout"), "{cut}");
        let heard = async {
            while !told.exists() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), heard)
            .await
            .unwrap_or_else(|_| panic!("{how}: the server's tool was never cancelled"));
    }
    served.stop().await.unwrap();
}
