//! The filters that bound a failure or route around it, each through the
//! real host: timeout fails a tool call past its deadline with a typed
//! timeout naming the filter (PEER-CASES I2-I4, and beyond the peer: an
//! inner failure before the deadline keeps its own error), and
//! model-fallback moves to the next model on the errors it is for (the
//! first seed's `middleware_model_fallback`).

use serde_json::{Value, json};
use shallot::types::{ChatRequest, ToolSpec};
use shallot::{ChainError, Context, ErrorKind, Kernel, LoadError};
use shallot_tests::{Reply, ScriptedModel, ask, load, spec};

use crate::loading::refused;

/// A kernel with the `timeout` filter at `timeout_ms` over a `slow` tool
/// (which never finishes), a `quick` one and a `broken` one.
async fn timed(timeout_ms: u32) -> Kernel {
    let plugins = load(vec![spec(
        "timeout",
        "timeout",
        json!({ "timeout_ms": timeout_ms }),
    )])
    .await;
    let tool = |name: &str| ToolSpec::new(name, name, json!({ "type": "object" }));
    Kernel::builder()
        .plugins(&plugins)
        .tool(tool("slow"), |_: Value, _| async {
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
            Ok(json!("slow"))
        })
        .tool(tool("quick"), |_: Value, _| async { Ok(json!("quick")) })
        .tool(tool("broken"), |_: Value, _| async {
            Err(shallot::ChainError::new(
                ErrorKind::Transient,
                "backend down",
            ))
        })
        .build()
        .unwrap()
}

// PEER-CASES I2
#[tokio::test]
async fn timeout_fails_a_slow_tool_with_a_typed_timeout_naming_the_filter() {
    let kernel = timed(50).await;
    let error = kernel
        .tool("slow", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert!(error.message.contains("50 ms"), "{error}");
    assert_eq!(&*error.origin.expect("attributed").filter, "timeout");
}

// PEER-CASES I3
#[tokio::test]
async fn timeout_lets_a_quick_tool_through() {
    let kernel = timed(1000).await;
    let response = kernel
        .tool("quick", json!({}), Context::new())
        .await
        .unwrap();
    assert_eq!(response.output, "\"quick\"");
}

#[tokio::test]
async fn timeout_keeps_an_inner_failure_before_the_deadline_as_it_was() {
    let kernel = timed(1000).await;
    let error = kernel
        .tool("broken", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::Transient, "backend down")
    );
    shallot_tests::assert_passed_on(&error, "timeout");
}

#[tokio::test]
async fn timeout_refuses_a_zero_or_unknown_configuration_at_load() {
    for (config, says) in [
        (json!({ "timeout_ms": 0 }), "greater than 0"),
        (json!({ "timeout": 5 }), "unknown field"),
        (json!(null), "timeout_ms"),
    ] {
        let error = refused("timeout", "timeout", config).await;
        assert!(matches!(error, LoadError::Filter { .. }), "{error}");
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// The model each call asked for (`None`: the default).
fn models_asked(model: &ScriptedModel) -> Vec<Option<String>> {
    model
        .requests()
        .iter()
        .map(|r| r.options.model.clone())
        .collect()
}

/// A chat through `model-fallback` with `config` over a model that fails
/// with `failures[i]` on call `i + 1` and answers after them.
async fn fall_back(
    config: Value,
    failures: Vec<ErrorKind>,
) -> (
    Result<shallot::types::ChatResponse, ChainError>,
    ScriptedModel,
) {
    let plugins = load(vec![spec("model_fallback", "model-fallback", config)]).await;
    let model =
        ScriptedModel::new(
            move |call, request: &ChatRequest| match failures.get(call - 1) {
                Some(&kind) => Reply::Fail(ChainError::new(kind, format!("failure {call}"))),
                None => {
                    let model = request.options.model.as_deref();
                    Reply::Text(format!("answer from {}", model.unwrap_or("default")))
                }
            },
        );
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    (kernel.chat(ask("hi"), Context::new()).await, model)
}

#[tokio::test]
async fn model_fallback_moves_to_the_next_model_on_the_errors_it_is_for() {
    for kind in [
        ErrorKind::Transient,
        ErrorKind::Timeout,
        ErrorKind::Auth,
        ErrorKind::NotFound,
    ] {
        let config = json!({ "models": ["backup-1", "backup-2"] });
        let (response, model) = fall_back(config, vec![kind]).await;
        assert_eq!(response.unwrap().text(), "answer from backup-1", "{kind:?}");
        assert_eq!(
            models_asked(&model),
            [None, Some("backup-1".to_owned())],
            "stops at the first model that works"
        );
    }
}

#[tokio::test]
async fn model_fallback_leaves_an_invalid_request_alone() {
    let config = json!({ "models": ["backup-1"] });
    let (response, model) = fall_back(config, vec![ErrorKind::InvalidRequest]).await;
    let error = response.unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn model_fallback_returns_the_last_failure_as_it_was_when_every_model_failed() {
    let config = json!({ "models": ["backup-1", "backup-2"] });
    let failures = vec![ErrorKind::Transient; 3];
    let (response, model) = fall_back(config, failures).await;
    let error = response.unwrap_err();
    assert_eq!(
        (error.kind, error.message.as_str()),
        (ErrorKind::Transient, "failure 3")
    );
    shallot_tests::assert_passed_on(&error, "model-fallback");
    assert_eq!(model.calls(), 3);
}

#[tokio::test]
async fn model_fallback_succeeds_at_once_without_another_call_and_can_be_told_its_errors() {
    let (response, model) = fall_back(json!({ "models": ["backup-1"] }), vec![]).await;
    assert_eq!(response.unwrap().text(), "answer from default");
    assert_eq!(model.calls(), 1);
    let config = json!({ "models": ["backup-1"], "on": ["limit-exceeded"] });
    let (response, _) = fall_back(config.clone(), vec![ErrorKind::Transient]).await;
    assert!(response.is_err(), "transient is not in its list");
    let (response, _) = fall_back(config, vec![ErrorKind::LimitExceeded]).await;
    assert_eq!(response.unwrap().text(), "answer from backup-1");
}

#[tokio::test]
async fn model_fallback_with_no_models_makes_one_call() {
    let (response, model) = fall_back(json!({ "models": [] }), vec![ErrorKind::Transient]).await;
    assert!(response.is_err());
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn model_fallback_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "models": "backup" }), "invalid type"),
        (
            json!({ "models": ["a"], "on": ["rate-limit"] }),
            "unknown variant",
        ),
        (json!({ "models": [""] }), "models[0] is empty"),
        (json!({}), "give `models` (or `upstreams`)"),
        (json!({ "models": ["a"], "upstreams": ["b"] }), "not both"),
        (json!({ "upstreams": [" "] }), "upstreams[0] is empty"),
    ] {
        let error = refused("model_fallback", "model-fallback", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// With `upstreams`, the fallback names the route's upstreams (the host
/// sends the call there): over a pool whose first upstream refuses the
/// gateway's key (which the pool itself does not fail over), the call
/// goes on to the one named, and the invoke's `upstream` key is put back.
#[tokio::test]
async fn model_fallback_falls_back_to_another_upstream_of_the_route() {
    let refusing = ScriptedModel::new(|_, _: &ChatRequest| {
        Reply::Fail(ChainError::new(ErrorKind::Auth, "the key is refused"))
    });
    let claude = ScriptedModel::answer("answer from claude");
    let pool = shallot::UpstreamPool::new(shallot::PoolConfig::default())
        .upstream("openai", 1, refusing.clone())
        .upstream("claude", 1, claude.clone());
    let plugins = load(vec![spec(
        "model_fallback",
        "model-fallback",
        json!({ "upstreams": ["claude"] }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(pool)
        .build()
        .unwrap();
    for _ in 0..2 {
        let context = Context::new();
        let answer = kernel.chat(ask("hi"), context.clone()).await.unwrap();
        assert_eq!(answer.text(), "answer from claude");
        assert_eq!(context.get(shallot::UPSTREAM), None, "put back as it was");
    }
    assert_eq!(
        (refusing.calls(), claude.calls()),
        (1, 2),
        "round robin, then the fallback"
    );

    // A name the route does not have is a not-found naming those it has.
    let plugins = load(vec![spec(
        "model_fallback",
        "model-fallback",
        json!({ "upstreams": ["gemini"] }),
    )])
    .await;
    let pool = shallot::UpstreamPool::new(shallot::PoolConfig::default()).upstream(
        "openai",
        1,
        ScriptedModel::new(|_, _: &ChatRequest| {
            Reply::Fail(ChainError::new(ErrorKind::Auth, "refused"))
        }),
    );
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(pool)
        .build()
        .unwrap();
    let error = kernel.chat(ask("hi"), Context::new()).await.unwrap_err();
    assert_eq!(error.kind, ErrorKind::NotFound, "{error}");
    assert!(error.message.contains("this route's are openai"), "{error}");
}
