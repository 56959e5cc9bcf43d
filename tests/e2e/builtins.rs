//! The built-in plugins: safeguard (PEER-CASES I8-I13), logging (I1),
//! timeout (I2-I4, and beyond the peer: an inner failure keeps its own
//! error), call-limit (seed 004's middleware) and token-redact (G1, and beyond the peer: secrets split across
//! tokens are caught within the declared look-back window).

use serde_json::{Value, json};
use shallot::types::{FinishReason, ToolSpec};
use shallot::{Context, ErrorKind, Kernel, LoadError};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, load, spec};

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

/// The error loading `plugin` as filter `name` with `config` fails with.
pub(crate) async fn refused(plugin: &str, name: &str, config: Value) -> LoadError {
    let specs = vec![spec(plugin, name, config)];
    shallot::PluginSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
        .await
        .err()
        .expect("the configuration is refused")
}

#[tokio::test]
async fn i8_safeguard_blocks_a_listed_word_without_calling_the_model() {
    let (response, calls) = guarded(json!({ "words": ["bomb"] }), "how to make a bomb").await;
    assert_eq!(response.finish_reason, FinishReason::ContentFiltered);
    assert_eq!(response.metadata.get("safeguard"), Some(&json!("blocked")));
    assert_eq!(calls, 0);
}

#[tokio::test]
async fn i9_safeguard_passes_other_requests() {
    let (response, calls) = guarded(json!({ "words": ["bomb"] }), "how to bake bread").await;
    assert_eq!(response.text(), "llm-answer");
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn i10_safeguard_ignores_case_by_default() {
    let (response, _) = guarded(json!({ "words": ["bomb"] }), "How To Make A BOMB").await;
    assert_eq!(response.finish_reason, FinishReason::ContentFiltered);
}

#[tokio::test]
async fn i11_safeguard_can_match_case() {
    let (response, _) = guarded(json!({ "words": ["bomb"], "case_sensitive": true }), "BOMB").await;
    assert_eq!(response.text(), "llm-answer");
}

#[tokio::test]
async fn i12_safeguard_answers_with_the_configured_failure_response() {
    let (response, _) = guarded(
        json!({ "words": ["bomb"], "failure_response": "NOPE" }),
        "bomb",
    )
    .await;
    assert_eq!(response.text(), "NOPE");
}

#[tokio::test]
async fn i13_safeguard_with_no_words_never_blocks() {
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

#[tokio::test]
async fn i1_logging_passes_everything_through() {
    let plugins = load(vec![spec("logging", "logging", Value::Null)]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("llm-answer"))
        .tool(ToolSpec::new("r", "", json!({})), |_, _| async {
            Ok(json!("r"))
        })
        .build()
        .unwrap();
    assert_eq!(
        kernel
            .tool("r", json!({}), Context::new())
            .await
            .unwrap()
            .output,
        "\"r\""
    );
    assert_eq!(
        kernel.chat(ask("hi"), Context::new()).await.unwrap().text(),
        "llm-answer"
    );
    let hooks: Vec<&str> = plugins.filters()[0]
        .hooks()
        .iter()
        .map(|h| h.as_str())
        .collect();
    assert_eq!(hooks, ["around-chat", "around-tool", "around-turn"]);
}

async fn redacted(config: Value, tokens: &[&str]) -> (String, Vec<String>) {
    let filters = vec![spec("token_redact", "redact", config)];
    let (answer, sink) = shallot_tests::stream(filters, Reply::tokens(tokens)).await;
    (answer.unwrap(), sink.tokens())
}

#[tokio::test]
async fn g1_redaction_changes_what_the_sink_sees_not_the_answer() {
    let config = json!({ "pattern": "key=\\w+", "replacement": "[REDACTED]", "window": 0 });
    let (answer, seen) = redacted(config, &["key=abc123 ok", " plain"]).await;
    assert_eq!(seen, ["[REDACTED] ok", " plain"]);
    assert_eq!(answer, "key=abc123 ok plain");
}

async fn redact_paced(window: usize, tokens: &[&str]) -> (String, String) {
    let config = json!({ "pattern": "sk-[a-z0-9]+", "replacement": "[KEY]", "window": window });
    let plugins = load(vec![spec("token_redact", "redact", config)]).await;
    let paced = Reply::Paced(
        tokens.iter().map(|t| t.to_string()).collect(),
        std::time::Duration::from_millis(5),
    );
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::replies(vec![paced]))
        .build()
        .unwrap();
    let sink = Collector::default();
    let response = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await
        .unwrap();
    (response.text(), sink.text())
}

#[tokio::test]
async fn a_secret_split_across_streamed_tokens_is_caught_within_the_window() {
    let (answer, seen) = redact_paced(32, &["my key: sk-a", "bc12", "3 ok"]).await;
    assert_eq!(seen, "my key: [KEY] ok");
    assert_eq!(answer, "my key: sk-abc123 ok");
}

#[tokio::test]
async fn without_a_window_a_split_secret_leaks_as_it_does_in_the_peer() {
    let (_, seen) = redact_paced(0, &["my key: sk-a", "bc12", "3 ok"]).await;
    assert_eq!(seen, "my key: [KEY]bc123 ok");
}

#[tokio::test]
async fn token_redact_rejects_a_bad_pattern_when_loaded() {
    let error = refused("token_redact", "redact", json!({ "pattern": "sk-[" })).await;
    assert!(error.to_string().contains("pattern"), "{error}");
}

/// A kernel with the `timeout` filter at `timeout_ms` over a `slow` tool
/// (sleeps 500 ms), a `quick` one and a `broken` one.
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
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
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

#[tokio::test]
async fn i2_timeout_fails_a_slow_tool_with_a_typed_timeout_naming_the_filter() {
    let kernel = timed(50).await;
    let error = kernel
        .tool("slow", json!({}), Context::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Timeout, "{error}");
    assert!(error.message.contains("50 ms"), "{error}");
    assert_eq!(&*error.origin.expect("attributed").filter, "timeout");
}

#[tokio::test]
async fn i3_timeout_lets_a_quick_tool_through() {
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

/// A stream for the redaction property: segments of text that never
/// matches, and secrets (`sk-` and up to ten letters or digits, each ended
/// by a space).
fn redaction_input() -> impl proptest::strategy::Strategy<Value = Vec<String>> {
    use proptest::prelude::*;
    let plain = proptest::string::string_regex("[abcxyz ,.!é你]{1,12}").unwrap();
    let secret = proptest::string::string_regex("sk-[a-z0-9]{1,10} ").unwrap();
    proptest::collection::vec(prop_oneof![plain, secret], 0..8)
}

/// What the caller must see of a segment.
fn shown(segment: &str) -> &str {
    if segment.starts_with("sk-") {
        "[KEY] "
    } else {
        segment
    }
}

/// How many characters of the input `seen` (a prefix of what the caller
/// must see) accounts for.
fn accounted(segments: &[String], seen: &str) -> usize {
    let mut rest = seen;
    let mut chars = 0;
    for segment in segments {
        let shown = shown(segment);
        if let Some(after) = rest.strip_prefix(shown) {
            chars += segment.chars().count();
            rest = after;
        } else {
            // Part of this segment: a secret is replaced whole, so only
            // plain text can be partly shown.
            chars += rest.chars().count();
            break;
        }
    }
    chars
}

/// Splits `text` into tokens at the character positions `cuts` name.
fn split_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    cuts.push(chars.len());
    cuts.sort();
    cuts.dedup();
    let mut start = 0;
    let mut tokens = Vec::new();
    for cut in cuts {
        tokens.push(chars[start..cut].iter().collect());
        start = cut;
    }
    tokens
}

const REDACT_WINDOW: usize = 16;
/// The longest secret the property streams: `sk-`, ten characters and the space.
const LONGEST_SECRET: usize = 14;

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// However the stream is split into tokens, the caller sees the same
    /// text with every secret redacted; and after each token, what is held
    /// back is at most the window (plus the rest of a secret that straddles
    /// its edge).
    #[test]
    fn token_redact_output_is_the_same_for_every_split_and_held_back_only_within_the_window(
        segments in redaction_input(),
        cuts in proptest::collection::vec(0usize..96, 0..12),
    ) {
        let input = segments.concat();
        let expected: String = segments.iter().map(|s| shown(s)).collect();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let config = json!({ "pattern": "sk-[a-z0-9]+", "replacement": "[KEY]", "window": REDACT_WINDOW });
            let plugins = load(vec![spec("token_redact", "redact", config)]).await;
            let kernel = shallot_tests::answering(&plugins, "");
            let sink = Collector::default();
            let mut stream = kernel.token_stream(Context::new(), sink.clone()).await.unwrap();
            let mut sent = 0;
            for token in split_at(&input, &cuts) {
                sent += token.chars().count();
                let mut batch = shallot::types::TokenBatch::default();
                batch.push(&token, None);
                stream.push(batch).await.unwrap();
                let seen = sink.text();
                assert!(expected.starts_with(&seen), "{seen:?} is not a prefix of {expected:?}");
                let held = sent - accounted(&segments, &seen);
                assert!(
                    held <= REDACT_WINDOW + LONGEST_SECRET,
                    "{held} characters held back after {sent} of {input:?}; shown {seen:?}"
                );
            }
            stream.finish(shallot::types::FinishReason::Complete).await.unwrap();
            assert_eq!(sink.text(), expected);
        });
    }
}

#[tokio::test]
async fn the_filters_without_options_and_trace_refuse_a_bad_configuration_at_load() {
    for (plugin, name, config, says) in [
        (
            "logging",
            "logging",
            json!({ "level": "debug" }),
            "unknown field `level`",
        ),
        (
            "final_answer",
            "final-answer",
            json!({ "tools": false }),
            "unknown field `tools`",
        ),
        ("trace", "trace", json!({ "turns": "yes" }), "invalid type"),
        (
            "trace",
            "trace",
            json!({ "sink": "stderr" }),
            "unknown field `sink`",
        ),
    ] {
        let error = refused(plugin, name, config).await;
        assert!(error.to_string().contains(says), "{plugin}: {error}");
    }
}
