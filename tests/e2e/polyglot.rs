//! Filters written in Python (componentize-py) and JavaScript
//! (componentize-js) against the same contract as the Rust guests: mixed
//! onions in both orders through the chat, tool and token chains, with the
//! behaviours the Rust probe shows (order, short-circuit, retry, FCtx
//! isolation, the flush cascade, a faulting filter contained), and the
//! example filters under examples/.
//!
//! Build them first: `scripts/build-polyglot`.

use serde_json::{Value, json};
use shallot::types::{Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{Context, ErrorKind, FilterSpec, Kernel};
use shallot_tests::{Reply, ScriptedModel, answering, ask, load, spec, stream, strings};

type Spec = (std::path::PathBuf, FilterSpec);

/// The three probes (Rust, Python, JavaScript) with the same configuration
/// plus a tag naming the language, in `order`.
fn probes(order: &[&str], config: Value) -> Vec<Spec> {
    order
        .iter()
        .map(|lang| {
            let mut config = config.clone();
            config["tag"] = json!(lang);
            let plugin = match *lang {
                "rust" => "probe",
                "py" => "py_probe",
                "js" => "js_probe",
                other => panic!("no {other} probe"),
            };
            spec(plugin, lang, config)
        })
        .collect()
}

fn trace_of(order: &[&str]) -> Vec<String> {
    let before = order.iter().map(|l| format!("{l}_before"));
    let after = order.iter().rev().map(|l| format!("{l}_after"));
    before.chain(after).collect()
}

const ORDERS: [[&str; 3]; 2] = [["rust", "py", "js"], ["js", "py", "rust"]];

fn echo_tool(builder: shallot::KernelBuilder) -> shallot::KernelBuilder {
    let spec = ToolSpec::new("echo", "echoes", json!({"type": "object"}));
    builder.tool(
        spec,
        |args: Value, _| async move { Ok(args["text"].clone()) },
    )
}

#[tokio::test]
async fn a_mixed_chat_onion_runs_outside_in_and_back_in_both_orders() {
    for order in ORDERS {
        let plugins = load(probes(&order, json!({ "hooks": ["chat"] }))).await;
        let model = ScriptedModel::answer("hello");
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model.clone())
            .build()
            .unwrap();
        let context = Context::new();
        let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
        assert_eq!(response.text(), "hello");
        assert_eq!(strings(&context, "trace"), trace_of(&order), "{order:?}");
        assert_eq!(model.requests().len(), 1);
    }
}

#[tokio::test]
async fn a_mixed_tool_onion_runs_outside_in_and_back_in_both_orders() {
    for order in ORDERS {
        let plugins = load(probes(&order, json!({ "hooks": ["tool"] }))).await;
        let kernel = echo_tool(Kernel::builder().plugins(&plugins))
            .build()
            .unwrap();
        let context = Context::new();
        let response = kernel
            .tool("echo", json!({"text": "ping"}), context.clone())
            .await
            .unwrap();
        assert_eq!(response.value().unwrap(), json!("ping"));
        assert_eq!(strings(&context, "trace"), trace_of(&order), "{order:?}");
    }
}

#[tokio::test]
async fn a_python_or_javascript_filter_short_circuits_the_layers_inside_it() {
    for (short, inner) in [("py", "js"), ("js", "py")] {
        let filters = vec![
            spec(
                &format!("{short}_probe"),
                short,
                json!({ "tag": short, "short_circuit": true, "hooks": ["chat", "tool"] }),
            ),
            spec(
                &format!("{inner}_probe"),
                inner,
                json!({ "tag": inner, "hooks": ["chat", "tool"] }),
            ),
        ];
        let plugins = load(filters).await;
        let model = ScriptedModel::answer("unused");
        let kernel = echo_tool(Kernel::builder().plugins(&plugins).model(model.clone()))
            .build()
            .unwrap();
        let context = Context::new();
        let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
        assert_eq!(response.text(), format!("short:{short}"));
        assert_eq!(
            strings(&context, "trace"),
            [format!("{short}_before"), format!("{short}_after")]
        );
        assert!(model.requests().is_empty(), "the model is never called");
        let tool = kernel
            .tool("echo", json!({"text": "x"}), Context::new())
            .await
            .unwrap();
        assert_eq!(tool.value().unwrap(), json!(format!("short:{short}")));
    }
}

#[tokio::test]
async fn a_python_or_javascript_filter_retries_by_calling_next_again() {
    for lang in ["py", "js"] {
        let filters = vec![
            spec(
                &format!("{lang}_probe"),
                lang,
                json!({ "tag": lang, "calls": 2, "hooks": ["chat"] }),
            ),
            spec(
                "probe",
                "inner",
                json!({ "tag": "inner", "hooks": ["chat"] }),
            ),
        ];
        let plugins = load(filters).await;
        let model = ScriptedModel::replies(vec![
            Reply::Text("first".into()),
            Reply::Text("second".into()),
        ]);
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model.clone())
            .build()
            .unwrap();
        let context = Context::new();
        let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
        assert_eq!(
            response.text(),
            "second",
            "{lang}: the last attempt's answer"
        );
        assert_eq!(model.requests().len(), 2);
        let inner: Vec<String> = strings(&context, "trace")
            .into_iter()
            .filter(|t| t.starts_with("inner"))
            .collect();
        assert_eq!(
            inner,
            ["inner_before", "inner_after", "inner_before", "inner_after"]
        );
    }
}

#[tokio::test]
async fn each_filter_has_its_own_fctx_for_one_invoke_whatever_its_language() {
    let plugins = load(probes(&["rust", "py", "js"], json!({ "count": true }))).await;
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({"text": "a"})),
        Reply::Text("done".into()),
        Reply::call("echo", json!({"text": "b"})),
        Reply::Text("done".into()),
    ]);
    let kernel = echo_tool(Kernel::builder().plugins(&plugins).model(model))
        .build()
        .unwrap();
    for _ in 0..2 {
        let context = Context::new();
        let result = kernel
            .turn(TurnRequest::new(vec![Message::user("go")]), context.clone())
            .await;
        assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
        for lang in ["rust", "py", "js"] {
            // around-turn once, around-chat twice, around-tool once: one
            // state across them, fresh for every invoke.
            assert_eq!(
                context.get(&format!("fctx:{lang}")).unwrap()["n"],
                4,
                "{lang}"
            );
        }
    }
}

#[tokio::test]
async fn tokens_pass_through_a_mixed_token_chain_in_layer_order_and_flush_in_cascade() {
    for order in ORDERS {
        let filters = order
            .iter()
            .map(|lang| {
                let plugin = if *lang == "rust" {
                    "probe".to_owned()
                } else {
                    format!("{lang}_probe")
                };
                let mut config = json!({ "hooks": ["tokens"], "prefix": &lang[..1] });
                if *lang == "py" {
                    config["batch"] = json!(2);
                }
                spec(&plugin, lang, config)
            })
            .collect();
        let (answer, sink) = stream(filters, Reply::tokens(&["a", "b", "c"])).await;
        assert_eq!(answer.unwrap(), "abc", "the answer keeps the model's text");
        // The first filter sees the raw tokens first; python batches two and
        // flushes the third, which the filters after it still transform.
        let expected = match order[0] {
            "rust" => ["jprarb", "jprc"],
            _ => ["rpjajb", "rpjc"],
        };
        assert_eq!(sink.tokens(), expected, "{order:?}");
    }
}

#[tokio::test]
async fn a_faulting_python_filter_fails_its_request_only() {
    let faulty = || {
        spec(
            "py_probe",
            "py",
            json!({ "fault": "chat", "hooks": ["chat"] }),
        )
    };
    let plugins = load(vec![faulty()]).await;
    let kernel = answering(&plugins, "hello");
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::PluginFault);
    assert_eq!(
        &*error
            .origin
            .as_ref()
            .expect("the error names its filter")
            .filter,
        "py"
    );
    assert!(
        error.to_string().contains("py-probe: fault in around_chat"),
        "the traceback, for the operator: {error}"
    );

    // An outer Rust filter gets the fault as a value it can handle, request
    // after request (each gets a fresh Python instance): which filter
    // faulted and how, not the traceback (the Python filter's internals).
    let outer = spec(
        "probe",
        "outer",
        json!({ "tag": "outer", "catch": true, "hooks": ["chat"] }),
    );
    let plugins = load(vec![outer, faulty()]).await;
    let kernel = answering(&plugins, "hello");
    for _ in 0..2 {
        let context = Context::new();
        let response = kernel.chat(ask("hi"), context.clone()).await.unwrap();
        assert!(
            response.text().starts_with("caught: "),
            "{}",
            response.text()
        );
        let caught = response.text();
        assert!(caught.contains("filter 'py' in around-chat"), "{caught}");
        assert!(
            !caught.contains("py-probe: fault in around_chat"),
            "{caught}"
        );
        assert_eq!(strings(&context, "trace"), ["outer_before", "outer_after"]);
    }
}

#[tokio::test]
async fn an_exception_in_a_javascript_filter_fails_its_request_with_its_message() {
    let plugins = load(vec![spec(
        "js_probe",
        "js",
        json!({ "fault": "chat", "hooks": ["chat"] }),
    )])
    .await;
    let kernel = answering(&plugins, "hello");
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::PluginFault);
    assert!(
        error.message.contains("js-probe: fault in aroundChat"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn a_faulting_token_step_ends_the_stream_without_a_flush() {
    for lang in ["py", "js"] {
        let filters = vec![
            spec(
                "probe",
                "batcher",
                json!({ "hooks": ["tokens"], "batch": 5 }),
            ),
            spec(
                &format!("{lang}_probe"),
                lang,
                json!({ "hooks": ["tokens"], "fault": "tokens" }),
            ),
        ];
        let tokens = Reply::tokens(&["a", "b", "c", "d", "e", "f"]);
        let (answer, sink) = stream(filters, tokens).await;
        let error = answer.unwrap_err();
        assert_eq!(error.kind, ErrorKind::PluginFault, "{lang}");
        assert!(sink.tokens().is_empty(), "{lang}: nothing half-delivered");
    }
}

#[tokio::test]
async fn a_bad_configuration_is_rejected_at_load_with_the_filters_message() {
    for plugin in ["py_probe", "js_probe", "pii_guard_py", "pii_guard_js"] {
        let specs = vec![spec(plugin, "bad", json!({ "colour": "red" }))];
        let error = shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
            .await
            .err()
            .unwrap_or_else(|| panic!("{plugin} accepted a bad configuration"));
        assert!(
            error.to_string().contains("unknown option(s): colour"),
            "{plugin}: {error}"
        );
    }
}

#[tokio::test]
async fn the_pii_guards_rewrite_the_request_before_the_model_sees_it() {
    for plugin in ["pii_guard_py", "pii_guard_js"] {
        let plugins = load(vec![spec(plugin, "pii", Value::Null)]).await;
        let model = ScriptedModel::answer("noted");
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model.clone())
            .build()
            .unwrap();
        let request = ask("Mail jane.doe@example.com or call +44 20 7946 0958 today.");
        let response = kernel.chat(request, Context::new()).await.unwrap();
        let seen = model.requests()[0].messages[0].text();
        assert_eq!(seen, "Mail [EMAIL] or call [PHONE] today.", "{plugin}");
        assert_eq!(response.metadata["pii_replaced"], 2, "{plugin}");
    }
}

#[tokio::test]
async fn the_word_masks_catch_words_split_across_tokens_and_flush_the_tail() {
    for plugin in ["word_mask_py", "word_mask_js"] {
        let config = json!({ "words": ["darn"], "mask": "#" });
        let tokens = Reply::tokens(&["Oh d", "ar", "n it, ", "Darn", "!"]);
        let (answer, sink) = stream(vec![spec(plugin, "mask", config)], tokens).await;
        assert_eq!(
            answer.unwrap(),
            "Oh darn it, Darn!",
            "{plugin}: the answer is untouched"
        );
        assert_eq!(sink.tokens().concat(), "Oh #### it, ####!", "{plugin}");
        assert_eq!(
            sink.deliveries().last().unwrap(),
            &vec!["####!".to_owned()],
            "{plugin}: the tail comes on flush"
        );
    }
}

#[tokio::test]
async fn an_inner_failure_a_python_or_javascript_filter_lets_through_keeps_its_origin() {
    for lang in ["py", "js"] {
        for (mimic, blamed) in [(false, "bad"), (true, lang)] {
            let plugins = load(vec![
                spec(
                    &format!("{lang}_probe"),
                    lang,
                    json!({ "hooks": ["chat", "turn"], "mimic": mimic }),
                ),
                spec("misbehave", "bad", json!({ "on": "chat", "do": "error" })),
            ])
            .await;
            let kernel = answering(&plugins, "hello");
            let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
            assert_eq!(error.kind, ErrorKind::Transient);
            assert_eq!(
                &*error.origin.expect("attributed").filter,
                blamed,
                "{lang}: an error it {} is blamed on {blamed}",
                if mimic { "built alike" } else { "let through" }
            );
        }
        let plugins = load(vec![
            spec(&format!("{lang}_probe"), lang, json!({ "hooks": ["turn"] })),
            spec("misbehave", "bad", json!({ "on": "turn", "do": "error" })),
        ])
        .await;
        let kernel = answering(&plugins, "hello");
        let result = kernel
            .turn(TurnRequest::new(vec![Message::user("go")]), Context::new())
            .await;
        let TurnResult::Error(error) = result else {
            panic!("{lang}: {result:?}")
        };
        assert_eq!(
            &*error.origin.expect("attributed").filter,
            "bad",
            "{lang}: a failed turn result handed back keeps its origin"
        );
    }
}

#[tokio::test]
async fn python_and_javascript_filters_keep_counters_and_windows_in_kv_with_their_sdks() {
    let counting = |lang: &str, store: Option<&str>| {
        let (path, mut filter) = probes(&[lang], json!({ "kv_count": "calls" })).remove(0);
        filter.grants.kv = store.map(|store| shallot::StoreSpec::from(store).into());
        (path, filter)
    };
    let store = ":memory:polyglot-kv";
    let plugins = load(vec![
        counting("py", Some(store)),
        counting("js", Some(store)),
    ])
    .await;
    let kernel = answering(&plugins, "ok");
    for n in 1..=3 {
        let context = Context::new();
        kernel.chat(ask("hi"), context.clone()).await.unwrap();
        for lang in ["py", "js"] {
            let seen = context.get(&format!("kv:{lang}")).unwrap();
            assert_eq!(seen["count"], n, "{lang}: {seen}");
            assert!(seen["version"].as_u64().unwrap() > 0, "{lang}: {seen}");
            // A window of two: the third take is refused, adding nothing.
            assert_eq!(seen["admitted"], n <= 2, "{lang}: {seen}");
            assert_eq!(seen["settled"], n.min(2), "{lang}: {seen}");
        }
    }
    let kept = shallot::open_kv(store).await.unwrap();
    for lang in ["py", "js"] {
        let counter = kept.get(lang, "calls").await.unwrap().unwrap();
        assert_eq!(counter.value, "3", "each filter's own namespace: {lang}");
    }
    for lang in ["py", "js"] {
        let plugins = load(vec![counting(lang, None)]).await;
        let error = answering(&plugins, "ok")
            .chat(ask("hi"), Context::new())
            .await
            .unwrap_err();
        assert_eq!(error.kind, ErrorKind::Auth, "{lang}: {error}");
        assert!(error.message.contains("kv ="), "{lang}: {error}");
    }
}

/// A Python and a JavaScript filter granted an origin call it with their
/// language's ordinary HTTP API (componentize-py's asyncio loop over
/// `wasi:http`, the platform's `fetch`); without the grant, the request
/// never leaves the host.
#[tokio::test]
async fn python_and_javascript_filters_call_a_granted_origin_with_their_own_http_apis() {
    let service = shallot_tests::WebService::start().await;
    for lang in ["py", "js"] {
        let fetching = |grant: bool| {
            let config = json!({ "tag": lang, "fetch": service.url("/hello") });
            let (path, mut filter) = probes(&[lang], config).remove(0);
            filter.grants.http = grant.then(|| shallot_tests::http_grant(&[&service.origin()]));
            (path, filter)
        };
        let plugins = load(vec![fetching(true)]).await;
        let context = Context::new();
        answering(&plugins, "ok")
            .chat(ask("hi"), context.clone())
            .await
            .unwrap();
        let fetched = context.get(&format!("fetched:{lang}")).unwrap();
        assert_eq!(fetched, "200 hello from the service", "{lang}");
        let before = service.hits();
        let plugins = load(vec![fetching(false)]).await;
        let error = answering(&plugins, "ok")
            .chat(ask("hi"), Context::new())
            .await
            .unwrap_err();
        assert_eq!(service.hits(), before, "{lang}: {error}");
    }
}

/// Python and JavaScript filters count in metrics of their own with their
/// SDKs, each under its own name.
#[tokio::test]
async fn python_and_javascript_filters_declare_metrics_with_their_sdks() {
    let plugins = load(probes(&["py", "js"], json!({ "metric": "probe_calls" }))).await;
    let kernel = answering(&plugins, "ok");
    for _ in 0..3 {
        kernel.chat(ask("hi"), Context::new()).await.unwrap();
    }
    for (filter, lang) in plugins.filters().iter().zip(["py", "js"]) {
        let metrics = filter.stats().metrics;
        assert_eq!(metrics.len(), 1, "{lang}: {metrics:?}");
        assert_eq!(metrics[0].name, "probe_calls");
        assert_eq!(
            metrics[0].series,
            [(vec![lang.to_owned()], shallot::MetricValue::Counter(3))],
            "{lang}"
        );
    }
}
