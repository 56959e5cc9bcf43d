//! MCP servers as tools of the agent: a real server on the official Python
//! SDK (`tests/mcp/server.py`, over stdio and over streamable HTTP), its
//! tools in the kernel under a
//! prefix with the server's schemas, each call through the tool chain (a
//! `trace` filter records it) to the server and back; and the server that
//! fails a call, hangs, dies, sends too much, floods its stderr, is not
//! there or does not speak MCP: each a typed error within its bound, the
//! server started again for the next call.
//!
//! Needs the `mcp` package in the polyglot venv: `scripts/build-polyglot`.

use std::sync::Arc;

use serde_json::{Value, json};
use shallot::types::{Message, TurnRequest, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel, McpConfig, McpServer};
use shallot_tests::{
    McpHttpServer, Reply, ScriptedModel, granted, lines, load, mcp_test_server, spec, target_dir,
    trace_file, trace_grant,
};

async fn started(timeout_ms: u64) -> Arc<McpServer> {
    McpServer::start(mcp_test_server(timeout_ms))
        .await
        .expect("the test server starts")
}

#[tokio::test]
async fn a_servers_tools_join_the_kernel_with_its_schemas_and_a_turn_calls_one_through_the_filters()
{
    let server = started(10_000).await;
    let tools = server.tools();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    for name in [
        "test_echo",
        "test_add",
        "test_fail",
        "test_hang",
        "test_die",
    ] {
        assert!(names.contains(&name), "{names:?}");
    }
    let echo = tools.iter().find(|t| t.name == "test_echo").unwrap();
    assert_eq!(echo.description, "Says the text back.");
    assert_eq!(
        echo.parameters["properties"]["text"]["type"], "string",
        "{}",
        echo.parameters
    );

    let path = trace_file("mcp-turn");
    let trace = spec(
        "trace",
        "trace",
        json!({ "arguments": true, "results": true }),
    );
    let plugins = load(vec![granted(trace, trace_grant(&path))]).await;
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("test_echo".into(), json!({ "text": "over MCP" })),
            ("test_add".into(), json!({ "a": 2, "b": 3 })),
        ]),
        Reply::Text("done".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .mcp(&server)
        .model(model.clone())
        .build()
        .unwrap();
    let TurnResult::Done(done) = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
        .await
    else {
        panic!("the turn ends");
    };
    let outputs: Vec<Value> = done
        .tool_calls
        .iter()
        .map(|c| serde_json::from_str(c.output.as_deref().expect("answered")).unwrap())
        .collect();
    // The Python SDK gives a function's value as structured content.
    assert_eq!(
        outputs,
        [json!({ "result": "over MCP" }), json!({ "result": 5 })]
    );
    let offered: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|t| t.name.clone())
        .collect();
    assert!(
        offered.contains(&"test_echo".to_owned()),
        "the model is offered them: {offered:?}"
    );
    let traced: Vec<Value> = lines(&path)
        .into_iter()
        .filter(|e| e["event"] == "tool")
        .collect();
    assert_eq!(traced.len(), 2, "each call went through the tool chain");
    let echo = traced.iter().find(|e| e["tool"] == "test_echo").unwrap();
    assert_eq!(
        (&echo["arguments"], &echo["output"]),
        (
            &json!({ "text": "over MCP" }),
            &json!({ "result": "over MCP" })
        )
    );

    // The server's schema is checked before the call leaves.
    let error = kernel
        .tool("test_add", json!({ "a": "two" }), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
}

/// A kernel over `server`'s tools, and nothing else.
fn kernel_of(server: &Arc<McpServer>) -> Kernel {
    Kernel::builder().mcp(server).build().unwrap()
}

/// The kernel's tool `tool` called with `arguments`: its output.
async fn call(kernel: &Kernel, tool: &str, arguments: Value) -> Result<String, ChainError> {
    Ok(kernel.tool(tool, arguments, Context::new()).await?.output)
}

/// Calls that fail, hang, die or answer past the message bound: each a
/// typed error (the hang at the call's bound, 3 s here), and the server
/// answers the next call, started again where it had to be.
/// A server's prompts (prefixed) and resources (by URI) are the kernel's:
/// a prompt got and a resource read run through the tool chain as calls
/// of their kind, which a filter sees (`trace` writes it), and the
/// server's answer is the output; a name or URI no server offers is
/// `not-found` before any filter runs.
#[tokio::test]
async fn a_servers_prompts_and_resources_pass_the_tool_chain_as_calls_of_their_kind() {
    let server = started(10_000).await;
    let prompts: Vec<String> = server.prompts().into_iter().map(|p| p.name).collect();
    assert_eq!(prompts, ["test_greet", "test_plain"]);
    let path = trace_file("mcp-kinds");
    let trace = spec(
        "trace",
        "trace",
        json!({ "arguments": true, "results": true }),
    );
    let plugins = load(vec![granted(trace, trace_grant(&path))]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .mcp(&server)
        .build()
        .unwrap();
    assert!(
        kernel.tools().iter().all(|t| t.name != "test_greet"),
        "a prompt is no tool the model is offered"
    );
    let got = kernel
        .prompt("test_greet", json!({ "name": "Bo" }), Context::new())
        .await
        .unwrap();
    let got = got.value().unwrap();
    assert_eq!(
        got["messages"][0]["content"]["text"],
        "Hello Bo, your code is SECRET-42"
    );
    let read = kernel
        .read_resource("test://rooms/attic", Context::new())
        .await
        .unwrap();
    assert_eq!(read.value().unwrap()["contents"][0]["text"], "room attic");
    let refused = kernel
        .prompt("test_greet", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(
        refused.kind,
        ErrorKind::InvalidRequest,
        "a required argument: {refused}"
    );
    for missing in [
        kernel
            .prompt("test_nothing", json!({}), Context::new())
            .await,
        kernel.read_resource("test://nowhere", Context::new()).await,
    ] {
        assert_eq!(missing.unwrap_err().kind, ErrorKind::NotFound);
    }
    let kinds: Vec<(String, String)> = lines(&path)
        .iter()
        .filter(|line| line["event"] == "tool")
        .map(|line| {
            (
                line["kind"].as_str().unwrap().into(),
                line["tool"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("prompt".into(), "test_greet".into()),
            ("resource".into(), "test://rooms/attic".into()),
            ("prompt".into(), "test_greet".into()),
        ]
    );
}

#[tokio::test]
async fn a_failing_hanging_or_dying_server_is_a_typed_error_and_is_started_again() {
    let kernel = kernel_of(&started(3_000).await);
    let call = |tool, arguments| call(&kernel, tool, arguments);
    let echo = || call("test_echo", json!({ "text": "still here" }));

    let error = call("test_fail", json!({ "why": "no such cargo" }))
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
    assert!(
        error.message.contains("no such cargo"),
        "the tool's own words: {error}"
    );
    assert_eq!(echo().await.unwrap(), r#"{"result":"still here"}"#);

    let error = call("test_hang", json!({})).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert!(error.message.contains("3000 ms"), "{error}");
    assert_eq!(
        echo().await.unwrap(),
        r#"{"result":"still here"}"#,
        "started again"
    );

    let error = call("test_die", json!({})).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient, "{error}");
    assert_eq!(
        echo().await.unwrap(),
        r#"{"result":"still here"}"#,
        "started again"
    );

    // Over `max_message_kib` (64): dropped, and the call ends at its bound.
    let error = call("test_huge", json!({ "kib": 200 })).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert_eq!(echo().await.unwrap(), r#"{"result":"still here"}"#);
}

/// A server that answers as much as the bound allows, floods its stderr
/// or writes garbage between its messages keeps its session, and calls
/// of one batch share it.
#[tokio::test]
async fn a_server_that_answers_big_floods_its_stderr_or_garbles_keeps_its_session() {
    let kernel = kernel_of(&started(60_000).await);
    let call = |tool, arguments| call(&kernel, tool, arguments);
    let echo = || call("test_echo", json!({ "text": "still here" }));
    let whole = call("test_huge", json!({ "kib": 16 })).await.unwrap();
    assert_eq!(
        whole.len(),
        r#"{"result":""}"#.len() + 16 * 1024,
        "under the bound, whole"
    );

    // Two megabytes of stderr without a newline, read a piece at a time.
    assert_eq!(
        call("test_shout", json!({ "times": 2048 })).await.unwrap(),
        r#"{"result":"done"}"#
    );

    // Lines that are not JSON-RPC on its stdout, mid-session: skipped,
    // the call answered, the session kept.
    let garbled = call("test_garble", json!({ "lines": 100 })).await.unwrap();
    assert_eq!(garbled, r#"{"result":"garbled"}"#);
    assert_eq!(echo().await.unwrap(), r#"{"result":"still here"}"#);

    // Calls of one batch share the session.
    let (a, b) = tokio::join!(echo(), call("test_add", json!({ "a": 1, "b": 1 })));
    assert_eq!(
        (a.unwrap(), b.unwrap()),
        (
            r#"{"result":"still here"}"#.to_owned(),
            r#"{"result":2}"#.to_owned()
        )
    );
}

#[tokio::test]
async fn a_server_that_is_not_there_or_does_not_speak_mcp_fails_to_start_saying_so() {
    let missing = McpConfig {
        command: Some("/nonexistent/mcp-server".into()),
        ..mcp_test_server(1_000)
    };
    let error = McpServer::start(missing).await.err().expect("refused");
    assert!(
        error
            .to_string()
            .contains("MCP server 'test': cannot start `/nonexistent/mcp-server`"),
        "{error}"
    );
    let garbage = McpConfig {
        command: Some("sh".into()),
        args: vec![
            "-c".into(),
            "echo '{not json'; echo '[1,2'; sleep 60".into(),
        ],
        start_timeout_ms: Some(500),
        ..mcp_test_server(60_000)
    };
    let error = McpServer::start(garbage).await.err().expect("refused");
    assert!(
        error.to_string().contains("did not start within 500 ms"),
        "{error}"
    );
}

/// `shallot serve`'s routes from a `shallot.toml` with an `[[mcp]]`
/// server: an agent route offers its tools, so a plain chat-completions
/// client gets an answer the server's tool made; a proxy route does not.
#[tokio::test]
async fn an_agent_route_of_the_gateway_calls_the_servers_tools_for_a_plain_client() {
    let dir = target_dir().join("test-scratch").join("mcp-routes");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let server = mcp_test_server(10_000);
    let toml = format!(
        "[[route]]\nmodel = \"agent\"\nmode = \"agent\"\nupstream = \"embedded\"\n\n\
         [[route]]\nmodel = \"proxy\"\nupstream = \"embedded\"\n\n\
         [[mcp]]\nname = \"test\"\ncommand = {:?}\nargs = [{:?}]\n",
        server.command.unwrap(),
        server.args[0],
    );
    std::fs::write(&file, toml).unwrap();
    let config = shallot::Config::read(&file).unwrap();
    let plugins = load(Vec::new()).await;
    let routes = shallot::Serving::from_config(Some(&config), &plugins, None)
        .await
        .unwrap()
        .routes;
    let served = crate::gateway::Served::gateway(shallot::Gateway::new(
        routes,
        shallot::GatewayConfig::default(),
    ))
    .await;
    let ask = |model: &str| json!({ "model": model, "messages": [{ "role": "user", "content": r#"call test_echo {"text": "from a client"}"# }] });
    let url = format!("{}/v1/chat/completions", served.base);
    let said = async |model: &str| -> String {
        let request = reqwest::Client::new().post(&url).json(&ask(model));
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("{answer}"))
            .to_owned()
    };
    let text = said("agent").await;
    assert!(
        text.contains("from a client") && text.contains("test_echo"),
        "{text}"
    );
    let text = said("proxy").await;
    assert!(
        text.starts_with("You said: call test_echo"),
        "a proxy route runs no tools: {text}"
    );
    served.stop().await.unwrap();
}

/// A server's tool that would take the name of one the kernel has (a
/// built-in's, another server's) is refused when the routes are built,
/// naming the tool and the server, instead of one hiding the other.
#[tokio::test]
async fn a_servers_tool_named_as_one_the_kernel_has_is_refused_naming_both() {
    let dir = target_dir().join("test-scratch").join("mcp-clash");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let server = mcp_test_server(10_000);
    let table = |name: &str, prefix: &str| {
        format!(
            "[[mcp]]\nname = {name:?}\nprefix = {prefix:?}\ncommand = {:?}\nargs = [{:?}]\n\n",
            server.command.as_deref().unwrap(),
            server.args[0],
        )
    };
    let plugins = load(Vec::new()).await;
    let cases = [
        (
            table("bare", ""),
            "the tool 'echo' of the MCP server 'bare'",
        ),
        (
            table("one", "t_") + &table("two", "t_"),
            "of the MCP server 'two' has the name of a tool the kernel already has",
        ),
    ];
    for (tables, said) in cases {
        let toml = format!("[[route]]\nmodel = \"agent\"\nmode = \"agent\"\n\n{tables}");
        std::fs::write(&file, toml).unwrap();
        let config = shallot::Config::read(&file).unwrap();
        let error = shallot::Serving::from_config(Some(&config), &plugins, None)
            .await
            .err()
            .expect("refused");
        assert!(error.to_string().contains(said), "{error}");
        assert!(error.to_string().contains("another `prefix`"), "{error}");
    }
}

#[tokio::test]
async fn a_server_over_streamable_http_gets_its_headers_and_is_reached_again_after_it_fails() {
    let http = McpHttpServer::start().await;
    let config = McpConfig {
        command: None,
        url: Some(http.url.clone()),
        headers: [("X-Tenant-Token".to_owned(), "t-42".to_owned())].into(),
        args: Vec::new(),
        ..mcp_test_server(3_000)
    };
    let server = McpServer::start(config).await.expect("it starts over HTTP");
    let kernel = Kernel::builder().mcp(&server).build().unwrap();
    let call = |tool: &'static str, arguments: Value| {
        let kernel = kernel.clone();
        async move { kernel.tool(tool, arguments, Context::new()).await }
    };
    assert_eq!(
        call("test_echo", json!({ "text": "over HTTP" }))
            .await
            .unwrap()
            .output,
        r#"{"result":"over HTTP"}"#
    );
    assert_eq!(
        call("test_header", json!({ "name": "X-Tenant-Token" }))
            .await
            .unwrap()
            .output,
        r#"{"result":"t-42"}"#,
        "the configured headers reach the server"
    );
    let error = call("test_fail", json!({ "why": "over HTTP too" }))
        .await
        .unwrap_err();
    assert!(
        error.kind == ErrorKind::InvalidRequest && error.message.contains("over HTTP too"),
        "{error}"
    );
    let error = call("test_hang", json!({})).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert_eq!(
        call("test_echo", json!({ "text": "again" }))
            .await
            .unwrap()
            .output,
        r#"{"result":"again"}"#,
        "a new session after the one that hung"
    );
    // Over `max_message_kib` (64): refused, and the next call still works.
    let error = call("test_huge", json!({ "kib": 200 })).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::Transient, "{error}");
    assert_eq!(
        call("test_echo", json!({ "text": "after" }))
            .await
            .unwrap()
            .output,
        r#"{"result":"after"}"#
    );
    let nobody = McpConfig {
        url: Some("http://127.0.0.1:9/mcp".into()),
        ..McpConfig {
            headers: Default::default(),
            ..mcp_test_server(1_000)
        }
    };
    let nobody = McpConfig {
        command: None,
        ..nobody
    };
    let error = McpServer::start(nobody)
        .await
        .err()
        .expect("nothing listens there");
    assert!(error.to_string().contains("MCP server 'test'"), "{error}");
}
