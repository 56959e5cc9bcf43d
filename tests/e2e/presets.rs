//! Presets of the built-ins (the first seed's `beamai_middleware_presets`):
//! a `[[filter]]` table naming one loads its filters, in its place, with
//! configurations the real plugins take, and they do what the seed's do.

use std::path::PathBuf;

use serde_json::json;
use shallot::types::{ChatRequest, Message};
use shallot::{ChainError, Context, ErrorKind, FilterSet, Kernel, PRESETS, read_config};
use shallot_tests::{Reply, ScriptedModel, engine, target_dir};

/// A `shallot.toml` of `body` whose plugins are the built guests.
fn config(name: &str, body: &str) -> PathBuf {
    let dir = target_dir().join("shallot-test-scratch").join("presets");
    std::fs::create_dir_all(&dir).unwrap();
    let guests = target_dir().join("wasm32-wasip2").join("guest");
    let path = dir.join(format!("{name}.toml"));
    let text = format!("plugin_dir = {:?}\n\n{body}", guests.display().to_string());
    std::fs::write(&path, text).unwrap();
    path
}

async fn loaded(name: &str, body: &str) -> FilterSet {
    let specs = read_config(&config(name, body)).expect("the file reads");
    FilterSet::from_specs(&engine(), specs, &mut |_| {})
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[tokio::test]
async fn every_preset_loads_its_filters_in_its_place() {
    for (name, _) in PRESETS {
        let body =
            format!("[[filter]]\nplugin = \"logging.wasm\"\n\n[[filter]]\npreset = \"{name}\"\n");
        let set = loaded(name, &body).await;
        let names: Vec<&str> = set.filters().iter().map(|f| f.name()).collect();
        let expect: &[&str] = match name {
            "minimal" => &["logging", "call-limit"],
            "default" => &["logging", "call-limit", "model-retry"],
            "production" => &["logging", "call-limit", "tool-retry", "model-retry"],
            "development" => &["logging", "call-limit", "tool-retry"],
            "human_in_loop" => &["logging", "call-limit", "approval"],
            other => panic!("a preset this test does not know: {other}"),
        };
        assert_eq!(names, expect, "{name}");
    }
}

#[tokio::test]
async fn the_production_preset_retries_a_passing_failure_and_bounds_the_model_calls() {
    let set = loaded(
        "production-behaves",
        "[[filter]]\npreset = \"production\"\n",
    )
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::Fail(ChainError::new(ErrorKind::Transient, "overloaded")),
        Reply::Text("fine".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&set)
        .model(model.clone())
        .build()
        .unwrap();
    let ask = ChatRequest::new(vec![Message::user("hi")]);
    let answer = kernel.chat(ask, Context::new()).await.unwrap();
    assert_eq!(answer.text(), "fine", "model-retry took the second answer");
    assert_eq!(model.requests().len(), 2);

    // call-limit at 15: the sixteenth model call of one turn fails.
    let calls = ScriptedModel::new(|_, _| Reply::call("echo", json!({})));
    let kernel = Kernel::builder()
        .plugins(&set)
        .model(calls.clone())
        .tool(
            shallot::types::ToolSpec::new("echo", "", json!({ "type": "object" })),
            |_: serde_json::Value, _| async { Ok(json!("again")) },
        )
        .turn_terminal(shallot::ToolLoop::new(
            shallot::LoopConfig {
                max_iterations: 30,
                ..shallot::LoopConfig::default()
            },
            shallot::NoHistory,
        ))
        .build()
        .unwrap();
    let turn = shallot::types::TurnRequest::new(vec![Message::user("loop")]);
    let shallot::types::TurnResult::Error(error) = kernel.turn(turn, Context::new()).await else {
        panic!("the turn stops at the limit");
    };
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(error.message.contains("limit of 15"), "{error}");
    assert_eq!(calls.requests().len(), 15);
}

#[tokio::test]
async fn a_preset_table_that_says_more_or_names_no_preset_is_refused() {
    for (body, says) in [
        (
            "[[filter]]\npreset = \"prod\"\n",
            "no preset 'prod' (there are minimal, default, production, development, human_in_loop)",
        ),
        (
            "[[filter]]\npreset = \"minimal\"\nconfig = { max_model_calls = 3 }\n",
            "a `preset` table takes nothing else",
        ),
        (
            "[[filter]]\npreset = \"minimal\"\nplugin = \"logging.wasm\"\n",
            "give one of `plugin` and `preset`",
        ),
        (
            "[[filter]]\nname = \"x\"\n",
            "give one of `plugin` and `preset`",
        ),
    ] {
        let error = read_config(&config("refused", body)).expect_err(body);
        let error = error.to_string();
        assert!(
            error.contains(says) && error.contains("line 3"),
            "{body}: {error}"
        );
    }
}
