//! The filters that stop what should not pass, each through the real
//! host: safeguard refuses a request with a listed word before the model
//! sees it (PEER-CASES I8-I13, and beyond the peer: tool results and the
//! text parts of multimodal messages), call-limit halts the model call past
//! its limit or warns and goes on (the first seed's `middleware_call_limit`), and
//! validation sends an answer that breaks its rules back with feedback
//! until one passes or its retries run out (PEER-CASES H7, H8).

use serde_json::{Value, json};
use shallot::types::{ChatRequest, FinishReason, ToolSpec, TurnResult};
use shallot::{ChainError, Context, ErrorKind, Kernel, LoadError};
use shallot_tests::{Reply, ScriptedModel, ask, load, spec};

use crate::agent::{done, go, texts};
use crate::loading::refused;

/// A kernel with `safeguard` configured with `config` over a model that
/// answers "llm-answer" and counts its calls.
async fn safeguarded(config: Value) -> (Kernel, ScriptedModel) {
    let plugins = load(vec![spec("safeguard", "safeguard", config)]).await;
    let model = ScriptedModel::answer("llm-answer");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    (kernel, model)
}

async fn guarded(config: Value, prompt: &str) -> (shallot::types::ChatResponse, usize) {
    let (kernel, model) = safeguarded(config).await;
    let response = kernel.chat(ask(prompt), Context::new()).await.unwrap();
    (response, model.calls())
}

// PEER-CASES I8
#[tokio::test]
async fn safeguard_blocks_a_listed_word_without_calling_the_model() {
    let (response, calls) = guarded(json!({ "words": ["bomb"] }), "how to make a bomb").await;
    assert_eq!(response.finish_reason, FinishReason::ContentFiltered);
    assert_eq!(response.metadata.get("safeguard"), Some(&json!("blocked")));
    assert_eq!(calls, 0);
}

// PEER-CASES I9
#[tokio::test]
async fn safeguard_passes_other_requests() {
    let (response, calls) = guarded(json!({ "words": ["bomb"] }), "how to bake bread").await;
    assert_eq!(response.text(), "llm-answer");
    assert_eq!(calls, 1);
}

// PEER-CASES I10
#[tokio::test]
async fn safeguard_ignores_case_by_default() {
    let (response, _) = guarded(json!({ "words": ["bomb"] }), "How To Make A BOMB").await;
    assert_eq!(response.finish_reason, FinishReason::ContentFiltered);
}

// PEER-CASES I11
#[tokio::test]
async fn safeguard_can_match_case() {
    let (response, _) = guarded(json!({ "words": ["bomb"], "case_sensitive": true }), "BOMB").await;
    assert_eq!(response.text(), "llm-answer");
}

// PEER-CASES I12
#[tokio::test]
async fn safeguard_answers_with_the_configured_failure_response() {
    let (response, _) = guarded(
        json!({ "words": ["bomb"], "failure_response": "NOPE" }),
        "bomb",
    )
    .await;
    assert_eq!(response.text(), "NOPE");
}

// PEER-CASES I13
#[tokio::test]
async fn safeguard_with_no_words_never_blocks() {
    let (_, calls) = guarded(json!({ "words": [] }), "bomb").await;
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn safeguard_checks_tool_results_fed_back_to_the_model() {
    let (kernel, _) = safeguarded(json!({ "words": ["bomb"] })).await;
    let mut request = ask("look this up");
    request
        .messages_mut()
        .push(shallot::types::Message::tool_result("1", "\"bomb recipe\""));
    let response = kernel.chat(request, Context::new()).await.unwrap();
    assert_eq!(response.finish_reason, FinishReason::ContentFiltered);
}

#[tokio::test]
async fn safeguard_scans_the_text_parts_of_multimodal_messages() {
    use shallot::types::{Content, ContentPart, Message, Role};
    let (kernel, model) = safeguarded(json!({ "words": ["bomb"] })).await;
    let parts = |last: &str| Message {
        role: Role::User,
        content: Some(Content::Parts(vec![
            ContentPart::Text {
                text: "what is in this picture of a ".into(),
            },
            ContentPart::Image {
                url: "https://example.com/b.png".into(),
                detail: None,
            },
            ContentPart::Text { text: last.into() },
        ])),
        tool_calls: Vec::new(),
        tool_call_id: None,
    };
    let blocked = kernel
        .chat(
            shallot::types::ChatRequest::new(vec![parts("Bomb?")]),
            Context::new(),
        )
        .await
        .unwrap();
    assert_eq!(blocked.finish_reason, FinishReason::ContentFiltered);
    let passed = kernel
        .chat(
            shallot::types::ChatRequest::new(vec![parts("cat?")]),
            Context::new(),
        )
        .await
        .unwrap();
    assert_eq!(passed.text(), "llm-answer");
    assert_eq!(model.calls(), 1, "only the second reached the model");
}

#[tokio::test]
async fn safeguard_rejects_an_unknown_option_when_loaded() {
    let error = refused("safeguard", "safeguard", json!({ "wordz": ["typo"] })).await;
    let LoadError::Filter { error, .. } = &error else {
        panic!("{error}")
    };
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(error.message.contains("unknown field `wordz`"), "{error}");
    assert_eq!(error.origin.as_ref().unwrap().call, "configure");
}

/// A turn whose model asks for the `echo` tool `rounds` times before it
/// answers, through `call-limit` with `config`: the result, and the model
/// calls made.
async fn limited(config: Value, rounds: usize) -> (shallot::types::TurnResult, usize) {
    let plugins = load(vec![spec("call_limit", "call-limit", config)]).await;
    let model = ScriptedModel::new(move |call, _: &shallot::types::ChatRequest| {
        if call <= rounds {
            Reply::call("echo", json!({}))
        } else {
            Reply::Text("done".into())
        }
    });
    let echo = ToolSpec::new("echo", "echoes", json!({ "type": "object" }));
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .tool(echo, |args: Value, _| async move { Ok(args) })
        .turn_terminal(shallot::ToolLoop::new(
            shallot::LoopConfig {
                max_iterations: 30,
                ..shallot::LoopConfig::default()
            },
            shallot::MemoryHistory::default(),
        ))
        .build()
        .unwrap();
    let turn = shallot::types::TurnRequest::new(vec![shallot::types::Message::user("go")]);
    let result = kernel.turn(turn, Context::new()).await;
    (result, model.calls())
}

#[tokio::test]
async fn call_limit_halts_the_call_past_the_limit_before_the_model_sees_it() {
    let (result, calls) = limited(json!({ "max_model_calls": 2 }), 3).await;
    let shallot::types::TurnResult::Error(error) = result else {
        panic!("{result:?}")
    };
    assert_eq!(error.kind, ErrorKind::LimitExceeded, "{error}");
    assert!(
        error.message.contains("model call 3") && error.message.contains("limit of 2"),
        "{error}"
    );
    assert_eq!(&*error.origin.expect("attributed").filter, "call-limit");
    assert_eq!(calls, 2, "the third call never reached the model");
}

#[tokio::test]
async fn call_limit_warns_and_goes_on_when_asked_to() {
    let (result, calls) = limited(json!({ "max_model_calls": 2, "on_limit": "warn" }), 3).await;
    assert!(
        matches!(result, shallot::types::TurnResult::Done(_)),
        "{result:?}"
    );
    assert_eq!(calls, 4);
}

#[tokio::test]
async fn call_limit_counts_per_invoke_and_defaults_to_twenty() {
    let (result, calls) = limited(json!({ "max_model_calls": 2 }), 1).await;
    assert!(
        matches!(result, shallot::types::TurnResult::Done(_)),
        "two calls fit: {result:?}"
    );
    assert_eq!(calls, 2);
    let (result, calls) = limited(json!(null), 19).await;
    assert!(
        matches!(result, shallot::types::TurnResult::Done(_)),
        "{result:?}"
    );
    assert_eq!(calls, 20);
    let (result, _) = limited(json!(null), 20).await;
    assert!(
        matches!(result, shallot::types::TurnResult::Error(_)),
        "the 21st call is over: {result:?}"
    );
}

#[tokio::test]
async fn call_limit_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "max_model_calls": "many" }), "invalid type"),
        (json!({ "on_limit": "stop" }), "unknown variant"),
        (json!({ "max_calls": 3 }), "unknown field"),
    ] {
        let error = refused("call_limit", "call-limit", config).await;
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

// PEER-CASES H7
#[tokio::test]
async fn validation_reenters_with_feedback_until_the_answer_passes() {
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

// PEER-CASES H8
#[tokio::test]
async fn validation_returns_the_last_answer_unchanged_when_retries_run_out() {
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
