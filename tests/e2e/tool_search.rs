//! The tool-search filter: PEER-CASES K (what each model call is offered,
//! and the search tool served by the filter) and L (the keyword and regex
//! indexes), through the host with the real plugin.

use serde_json::{Value, json};
use shallot::types::{ChatRequest, Message, Role, ToolCall, ToolSpec};
use shallot::{Context, Kernel};
use shallot_tests::{Reply, ScriptedModel, load, spec};

use crate::agent::{done, go};
use crate::loading::refused;

fn chinese_tools() -> Vec<(&'static str, &'static str)> {
    vec![
        ("get_weather", "查询指定城市的天气预报"),
        ("send_email", "给收件人发送一封电子邮件"),
        ("create_invoice", "创建一张发票"),
        ("list_files", "列出目录中的文件"),
        ("run_sql", "在数据库上执行 SQL 查询"),
    ]
}

fn english_tools() -> Vec<(&'static str, &'static str)> {
    vec![
        ("get_weather", "Get the current weather for a city"),
        ("sendEmail", "Send an email message to a recipient"),
        ("list_files", "List files in a directory"),
        ("read_file", "Read the contents of a file"),
        ("create_ticket", "Create a support ticket"),
        ("search_web", "Search the web for information"),
        ("convert_currency", "Convert an amount between currencies"),
        ("restart_server", "Restart a production server"),
    ]
}

fn kernel(
    config: Value,
    tools: &[(&str, &str)],
    model: ScriptedModel,
) -> impl std::future::Future<Output = Kernel> {
    let tools: Vec<(String, String)> = tools
        .iter()
        .map(|(n, d)| (n.to_string(), d.to_string()))
        .collect();
    async move {
        let plugins = load(vec![spec("tool_search", "tool-search", config)]).await;
        let mut builder = Kernel::builder().plugins(&plugins).model(model);
        for (name, description) in tools {
            let reply = name.clone();
            builder = builder.tool(
                ToolSpec::new(&name, &description, json!({ "type": "object" })),
                move |_: Value, _| {
                    let reply = reply.clone();
                    async move { Ok(json!(format!("ran {reply}"))) }
                },
            );
        }
        builder.build().unwrap()
    }
}

/// The names of the tools a model call was offered, sorted.
fn offered(request: &ChatRequest) -> Vec<String> {
    let mut names: Vec<String> = request.tools.iter().map(|t| t.name.clone()).collect();
    names.sort();
    names
}

/// A search round: the model calls the search tool (`id`), and its result.
fn search_round(id: &str, result: &str) -> Vec<Message> {
    let mut call = Message::assistant("");
    call.content = None;
    call.tool_calls = vec![ToolCall {
        id: id.into(),
        name: "tool_search".into(),
        arguments: "{}".into(),
    }];
    vec![call, Message::tool_result(id, result)]
}

/// What one chat call with `rounds` of search results is offered.
async fn offered_after(config: Value, rounds: &[&str]) -> Vec<String> {
    let model = ScriptedModel::answer("ok");
    let kernel = kernel(config, &chinese_tools(), model.clone()).await;
    let mut messages = vec![Message::user("help")];
    for (i, result) in rounds.iter().enumerate() {
        messages.extend(search_round(&format!("s{i}"), result));
    }
    let specs: Vec<ToolSpec> = kernel.tools();
    let request = ChatRequest {
        messages: messages.into(),
        tools: specs.into(),
        ..Default::default()
    };
    kernel.chat(request, Context::new()).await.unwrap();
    offered(&model.requests()[0])
}

// PEER-CASES K1, K2, K3, K4, K5, K7, K8
#[tokio::test]
async fn each_call_is_offered_the_search_tool_and_what_searches_found() {
    let cases: Vec<(Value, Vec<&str>, Vec<&str>)> = vec![
        (json!(null), vec![], vec!["tool_search"]),
        (
            json!(null),
            vec![r#"["get_weather"]"#],
            vec!["get_weather", "tool_search"],
        ),
        (
            json!(null),
            vec![r#"["get_weather"]"#, r#"["send_email"]"#],
            vec!["get_weather", "send_email", "tool_search"],
        ),
        (
            json!({ "accumulate": false }),
            vec![r#"["get_weather"]"#, r#"["send_email"]"#],
            vec!["send_email", "tool_search"],
        ),
        (json!(null), vec!["[]"], vec!["tool_search"]),
        (json!(null), vec![r#"["ghost_tool"]"#], vec!["tool_search"]),
        (json!(null), vec!["not json{"], vec!["tool_search"]),
        (
            json!({ "unindexed": ["run_sql"] }),
            vec![],
            vec!["run_sql", "tool_search"],
        ),
    ];
    for (config, rounds, expected) in cases {
        assert_eq!(
            offered_after(config.clone(), &rounds).await,
            expected,
            "{config} {rounds:?}"
        );
    }
}

// PEER-CASES K10
#[tokio::test]
async fn a_request_without_tools_is_left_without_tools() {
    let model = ScriptedModel::answer("ok");
    let kernel = kernel(json!(null), &chinese_tools(), model.clone()).await;
    kernel
        .chat(shallot_tests::ask("hi"), Context::new())
        .await
        .unwrap();
    assert!(model.requests()[0].tools.is_empty());
}

/// A turn in which the model searches for `query` and then answers: the
/// search's result, and what the second call was offered.
async fn found_in_turn(
    config: Value,
    tools: &[(&str, &str)],
    query: &str,
) -> (Vec<String>, Vec<String>) {
    let name = config
        .get("tool_name")
        .and_then(Value::as_str)
        .unwrap_or("tool_search")
        .to_owned();
    let query = query.to_owned();
    let model = ScriptedModel::new(move |call, _: &ChatRequest| match call {
        1 => Reply::call(&name, json!({ "query": query })),
        _ => Reply::Text("done".into()),
    });
    let kernel = kernel(config, tools, model.clone()).await;
    done(kernel.turn(go("help"), Context::new()).await);
    let requests = model.requests();
    let result = requests[1]
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .expect("the search's result")
        .text();
    (
        serde_json::from_str(&result).expect("a JSON array of names"),
        offered(&requests[1]),
    )
}

async fn found(config: Value, tools: &[(&str, &str)], query: &str) -> Vec<String> {
    found_in_turn(config, tools, query).await.0
}

// PEER-CASES K11, K15, K16
#[tokio::test]
async fn a_search_in_a_turn_finds_the_tool_which_is_then_offered() {
    let (result, offered) =
        found_in_turn(json!(null), &chinese_tools(), "weather forecast 天气").await;
    assert!(result.contains(&"get_weather".to_owned()), "{result:?}");
    assert!(offered.contains(&"get_weather".to_owned()), "{offered:?}");
    assert!(
        found(json!(null), &chinese_tools(), "查询天气")
            .await
            .contains(&"get_weather".to_owned())
    );
    assert_eq!(
        found(json!(null), &english_tools(), "weather").await[0],
        "get_weather"
    );
}

// PEER-CASES K12, K13, K14
#[tokio::test]
async fn results_are_capped_and_an_empty_or_missing_query_finds_nothing() {
    let many = found(
        json!({ "max_results": 2 }),
        &english_tools(),
        "email file server weather ticket",
    )
    .await;
    assert!(many.len() <= 2 && !many.is_empty(), "{many:?}");
    for index in ["keyword", "regex"] {
        assert_eq!(
            found(json!({ "index": index }), &english_tools(), "").await,
            Vec::<String>::new(),
            "{index}"
        );
    }
}

// PEER-CASES K17
#[tokio::test]
async fn the_search_tool_can_be_renamed() {
    assert_eq!(
        offered_after(json!({ "tool_name": "find_tool" }), &[]).await,
        ["find_tool"]
    );
    let (result, _) = found_in_turn(
        json!({ "tool_name": "find_tool" }),
        &english_tools(),
        "weather",
    )
    .await;
    assert_eq!(result[0], "get_weather");
}

// PEER-CASES L1, L3, L5, L10, L11, L12, L13
#[tokio::test]
async fn the_regex_index_finds_tools_by_pattern() {
    let regex = || json!({ "index": "regex" });
    assert_eq!(
        found(regex(), &english_tools(), "weather").await,
        ["get_weather"]
    );
    assert_eq!(
        found(
            json!({ "index": "regex", "max_results": 1 }),
            &english_tools(),
            "file"
        )
        .await,
        ["list_files"]
    );
    assert_eq!(
        found(regex(), &english_tools(), "[unclosed").await,
        Vec::<String>::new()
    );
    let pair = [
        ("send_email", "Send a note about the weather"),
        ("weather_lookup", "Fetch data for a place"),
    ];
    assert_eq!(
        found(regex(), &pair, "weather").await,
        ["weather_lookup", "send_email"]
    );
    assert_eq!(
        found(regex(), &english_tools(), "WEATHER").await,
        ["get_weather"]
    );
    assert_eq!(
        found(
            json!({ "index": "regex", "case_sensitive": true }),
            &english_tools(),
            "WEATHER"
        )
        .await,
        Vec::<String>::new()
    );
    assert_eq!(
        found(regex(), &english_tools(), "zzzznope").await,
        Vec::<String>::new()
    );
}

// PEER-CASES L2, L4, L7, L8, L9, L13
#[tokio::test]
async fn the_keyword_index_finds_tools_by_word() {
    let tools = english_tools();
    assert_eq!(
        found(json!(null), &tools, "weather").await[0],
        "get_weather"
    );
    assert_eq!(
        found(json!({ "max_results": 1 }), &tools, "file")
            .await
            .len(),
        1
    );
    assert_eq!(
        found(json!(null), &tools, "send_email").await[0],
        "sendEmail"
    );
    assert_eq!(
        found(json!(null), &tools, "getWeather").await[0],
        "get_weather"
    );
    let pair = [
        ("send_email", "Send a note about the weather"),
        ("weather_lookup", "Fetch data for a place"),
    ];
    assert_eq!(
        found(json!(null), &pair, "weather").await,
        ["weather_lookup", "send_email"]
    );
    assert_eq!(
        found(json!(null), &tools, "zzzznope").await,
        Vec::<String>::new()
    );
}

// PEER-CASES L15, L16, L17, L19, L20, L21, L23
#[tokio::test]
async fn cjk_text_is_indexed_in_bigrams_split_at_other_scripts_and_punctuation() {
    let pair = [
        ("get_weather", "查询指定城市的天气预报"),
        ("send_email", "给收件人发送一封电子邮件"),
    ];
    assert_eq!(found(json!(null), &pair, "天气").await, ["get_weather"]);
    assert_eq!(
        found(json!(null), &pair, "查询天气").await[0],
        "get_weather"
    );
    assert_eq!(found(json!(null), &pair, "邮件").await, ["send_email"]);
    assert_eq!(
        found(json!(null), &pair, "天").await,
        Vec::<String>::new(),
        "L19: only bigrams are indexed"
    );
    assert_eq!(
        found(json!(null), &pair, "数据库").await,
        Vec::<String>::new()
    );
    let mixed = [("mixed", "天气weather 混排")];
    assert_eq!(found(json!(null), &mixed, "weather").await, ["mixed"]);
    assert_eq!(found(json!(null), &mixed, "天气").await, ["mixed"]);
    let punctuated = [("p", "查询天气。发送邮件！")];
    assert_eq!(found(json!(null), &punctuated, "天气").await, ["p"]);
    assert_eq!(found(json!(null), &punctuated, "邮件").await, ["p"]);
}

#[tokio::test]
async fn a_found_tool_runs_and_a_tool_never_offered_still_runs_as_in_the_peer() {
    let model = ScriptedModel::new(|call, _: &ChatRequest| match call {
        1 => Reply::call("tool_search", json!({ "query": "weather" })),
        2 => Reply::call("get_weather", json!({})),
        3 => Reply::call("run_sql", json!({})),
        _ => Reply::Text("done".into()),
    });
    let kernel = kernel(json!(null), &chinese_tools(), model.clone()).await;
    let done = done(kernel.turn(go("help"), Context::new()).await);
    let outputs: Vec<Option<String>> = done.tool_calls.iter().map(|c| c.output.clone()).collect();
    assert_eq!(outputs[1].as_deref(), Some("\"ran get_weather\""));
    assert_eq!(outputs[2].as_deref(), Some("\"ran run_sql\""));
}

#[tokio::test]
async fn tool_search_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "index": "vector" }), "unknown variant"),
        (json!({ "max_results": 0 }), "max_results"),
        (json!({ "tool_name": " " }), "tool_name"),
        (json!({ "b": 2 }), "b between 0 and 1"),
        (json!({ "maxresults": 3 }), "unknown field"),
    ] {
        let error = refused("tool_search", "tool-search", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

#[tokio::test]
async fn a_tool_the_filter_offers_keeps_what_the_host_knows_of_it() {
    let model = ScriptedModel::answer("ok");
    let kernel = kernel(
        json!({ "unindexed": ["get_weather"] }),
        &chinese_tools(),
        model.clone(),
    )
    .await;
    let request = ChatRequest {
        messages: vec![Message::user("weather?")].into(),
        tools: vec![ToolSpec::new("get_weather", "weather", json!({ "type": "object" })).strict()]
            .into(),
        ..Default::default()
    };
    kernel.chat(request, Context::new()).await.unwrap();
    let seen = &model.requests()[0];
    assert_eq!(offered(seen), ["get_weather", "tool_search"]);
    let weather = seen.tools.iter().find(|t| t.name == "get_weather").unwrap();
    assert!(
        weather.strict,
        "rewritten by the filter's set-tools, the tool is still strict"
    );
    let search = seen.tools.iter().find(|t| t.name == "tool_search").unwrap();
    assert!(!search.strict, "the filter's own tool is not");
}

#[tokio::test]
async fn it_indexes_the_registered_tools_and_an_interrupt_tool_or_a_filters_tool_passes_through() {
    for (config, expect) in [
        (json!(null), vec!["tool_search", "ask_human", "lookup"]),
        (
            json!({ "unindexed": ["get_weather"] }),
            vec!["tool_search", "ask_human", "get_weather", "lookup"],
        ),
        (json!({ "indexes": "all" }), vec!["tool_search"]),
    ] {
        let plugins = load(vec![spec("tool_search", "tool-search", config.clone())]).await;
        let model = ScriptedModel::answer("ok");
        let mut builder = Kernel::builder()
            .filter(crate::access::Adds)
            .plugins(&plugins)
            .model(model.clone());
        for (name, description) in english_tools() {
            builder = builder.tool(
                ToolSpec::new(name, description, json!({ "type": "object" })),
                |_: Value, _| async { Ok(json!("ran")) },
            );
        }
        let ask = ToolSpec::new("ask_human", "asks a human", json!({ "type": "object" }));
        let kernel = builder.interrupt_tool(ask).build().unwrap();
        done(kernel.turn(go("help"), Context::new()).await);
        // The search tool, then the request's tools in their order (the
        // loop offers the registered ones by name).
        let names: Vec<String> = model.requests()[0]
            .tools
            .iter()
            .map(|t| t.name.clone())
            .collect();
        assert_eq!(names, expect, "{config}");
    }
}

#[tokio::test]
async fn a_filter_that_asks_its_registered_tools_without_end_fails_only_its_own_call() {
    let chatter = spec(
        "misbehave",
        "chatter",
        json!({ "on": "chat", "do": "registered-chatter" }),
    );
    let plugins = load(vec![chatter]).await;
    let mut builder = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok"));
    for i in 0..500 {
        let spec = ToolSpec::new(
            format!("tool_{i:03}"),
            "a tool",
            json!({ "type": "object" }),
        );
        builder = builder.tool(spec, |_: Value, _| async { Ok(json!("ran")) });
    }
    let kernel = builder.build().unwrap();
    let request = ChatRequest {
        messages: vec![Message::user("hi")].into(),
        tools: kernel.tools().into(),
        ..Default::default()
    };
    let error = kernel.chat(request, Context::new()).await.unwrap_err();
    assert_eq!(error.kind, shallot::ErrorKind::PluginFault, "{error}");
    assert_eq!(
        error.origin.unwrap().filter.as_ref(),
        "chatter",
        "its own fault"
    );
}
