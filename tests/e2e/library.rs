//! The built-in filters of the library beyond the first five: model-fallback
//! (seed 004's `middleware_model_fallback`), validation (PEER-CASES H7, H8)
//! and hold-release (G3, G4), each through the real host.

use serde_json::{Value, json};
use shallot::types::{ChatRequest, FinishReason, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel};
use shallot_tests::{Reply, ScriptedModel, ask, load, spec};

use crate::agent::{done, go, texts};
use crate::builtins::refused;

/// The model each call asked for (`None`: the default).
fn models_asked(model: &ScriptedModel) -> Vec<Option<String>> {
    model
        .requests()
        .iter()
        .map(|r| {
            r.options
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
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
                    let model = request.options.get("model").and_then(Value::as_str);
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
        (json!({}), "missing field `models`"),
    ] {
        let error = refused("model_fallback", "model-fallback", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// A turn ("MY-QUESTION") through `filter` over a model that answers
/// `answers` in order (the last one again after them): the result and
/// the model.
pub(crate) async fn answered(
    filter: (std::path::PathBuf, shallot::FilterSpec),
    answers: &[&str],
) -> (TurnResult, ScriptedModel) {
    let plugins = load(vec![filter]).await;
    let answers: Vec<String> = answers.iter().map(|a| a.to_string()).collect();
    let model = ScriptedModel::new(move |call, _: &ChatRequest| {
        Reply::Text(answers[(call - 1).min(answers.len() - 1)].clone())
    });
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    (kernel.turn(go("MY-QUESTION"), Context::new()).await, model)
}

async fn validated(config: Value, answers: &[&str]) -> (TurnResult, ScriptedModel) {
    answered(spec("validation", "validation", config), answers).await
}

#[tokio::test]
async fn h7_validation_reenters_with_feedback_until_the_answer_passes() {
    let config = json!({ "required": ["good"], "max_retries": 2 });
    let (result, model) = validated(config, &["bad", "good"]).await;
    assert_eq!(done(result).response.text(), "good");
    assert_eq!(model.calls(), 2);
    let second = texts(&model.requests()[1].messages);
    assert_eq!(second[..2], ["MY-QUESTION", "bad"]);
    assert!(
        second[2].contains("did not pass validation") && second[2].contains("\"good\""),
        "{second:?}"
    );
}

#[tokio::test]
async fn h8_validation_returns_the_last_answer_unchanged_when_retries_run_out() {
    let config = json!({ "required": ["good"], "max_retries": 1 });
    let (result, model) = validated(config, &["bad"]).await;
    assert_eq!(done(result).response.text(), "bad");
    assert_eq!(model.calls(), 2);
}

#[tokio::test]
async fn validation_names_every_rule_broken_in_its_own_feedback() {
    let config = json!({
        "must_match": ["^[A-Z]"],
        "must_not_match": ["(?i)as an ai"],
        "max_length": 10,
        "max_retries": 1,
        "feedback": "Fix this: {reason}",
    });
    let (result, model) = validated(config, &["as an AI, I think so", "Yes."]).await;
    assert_eq!(done(result).response.text(), "Yes.");
    let feedback = texts(&model.requests()[1].messages).pop().unwrap();
    assert!(feedback.starts_with("Fix this: "), "{feedback}");
    for says in [
        "must match /^[A-Z]/",
        "must not match /(?i)as an ai/",
        "20 characters long, more than 10",
    ] {
        assert!(feedback.contains(says), "{feedback} lacks {says}");
    }
}

#[tokio::test]
async fn validation_passes_a_failed_turn_through_without_reentering() {
    let plugins = load(vec![spec(
        "validation",
        "validation",
        json!({ "required": ["x"] }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![Reply::Fail(ChainError::new(
        ErrorKind::Auth,
        "no key",
    ))]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let result = kernel.turn(go("q"), Context::new()).await;
    let TurnResult::Error(error) = result else {
        panic!("{result:?}")
    };
    assert_eq!(error.kind, ErrorKind::Auth);
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn validation_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "must_match": ["(unclosed"] }), "must_match[0]"),
        (json!({ "max_retries": -1 }), "invalid value"),
        (json!({ "feedback": "no placeholder" }), "{reason}"),
        (json!({ "requried": ["x"] }), "unknown field"),
    ] {
        let error = refused("validation", "validation", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// What the caller sees of a stream of `tokens` (with metadata) through
/// `hold-release` with `config`, and the answer.
async fn held(
    config: Value,
    tokens: Vec<(String, Option<String>)>,
) -> (Vec<(String, Option<String>)>, String) {
    let filters = vec![spec("hold_release", "hold-release", config)];
    let (answer, sink) = shallot_tests::stream(filters, Reply::Tokens(tokens)).await;
    (sink.tokens_with_meta(), answer.unwrap())
}

fn token(text: &str, meta: Option<&str>) -> (String, Option<String>) {
    (text.to_owned(), meta.map(str::to_owned))
}

#[tokio::test]
async fn g3_hold_release_releases_the_original_tokens_in_order_with_their_meta() {
    let tokens = vec![token("he", Some(r#"{"k":1}"#)), token("llo", None)];
    let (seen, answer) = held(json!({ "words": ["bomb"] }), tokens.clone()).await;
    assert_eq!(seen, tokens);
    assert_eq!(answer, "hello");
}

#[tokio::test]
async fn g4_hold_release_replaces_a_blocked_stream_with_one_token() {
    let tokens = vec![token("bad", None), token(" stuff", None)];
    let config = json!({ "words": ["BAD"], "replacement": "[BLOCKED]" });
    let (seen, answer) = held(config, tokens).await;
    assert_eq!(seen, [token("[BLOCKED]", None)]);
    assert_eq!(answer, "bad stuff", "the answer itself is unchanged");
}

#[tokio::test]
async fn hold_release_checks_the_whole_text_so_a_split_match_is_caught() {
    let tokens = vec![token("card 4111 1111", None), token(" 1111 1111 ok", None)];
    let config = json!({ "patterns": ["\\d{4}( \\d{4}){3}"], "case_sensitive": true });
    let (seen, _) = held(config, tokens).await;
    assert_eq!(seen, [token("[withheld]", None)]);
}

#[tokio::test]
async fn hold_release_holds_in_every_output_mode() {
    let plugins = load(vec![spec(
        "hold_release",
        "hold-release",
        json!({ "words": ["secret"] }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("the secret is 42"))
        .build()
        .unwrap();
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(response.finish_reason, FinishReason::Complete);
    assert_eq!(
        kernel
            .delivered_text(&response.text(), Context::new())
            .await
            .unwrap(),
        "[withheld]"
    );
}

#[tokio::test]
async fn hold_release_refuses_a_bad_pattern_at_load() {
    for (config, says) in [
        (json!({ "patterns": ["[unclosed"] }), "patterns[0]"),
        (json!({ "patterns": ["x*"] }), "matches the empty string"),
        (json!({ "word": ["x"] }), "unknown field"),
    ] {
        let error = refused("hold_release", "hold-release", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}
