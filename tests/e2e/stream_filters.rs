//! The filters that act on a stream as it reaches the caller, each
//! through the real host: token-redact rewrites secrets in what the caller
//! sees, not in the answer (PEER-CASES G1, and beyond the peer: a secret
//! split across tokens is caught within the declared look-back window,
//! however the stream is split), and hold-release holds the stream back
//! until the whole text is checked, then releases the tokens as they came
//! or one replacement (PEER-CASES G3, G4).

use serde_json::{Value, json};
use shallot::types::FinishReason;
use shallot::{Context, Kernel};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, load, spec};

use crate::loading::refused;

async fn redacted(config: Value, tokens: &[&str]) -> (String, Vec<String>) {
    let filters = vec![spec("token_redact", "redact", config)];
    let (answer, sink) = shallot_tests::stream(filters, Reply::tokens(tokens)).await;
    (answer.unwrap(), sink.tokens())
}

// PEER-CASES G1
#[tokio::test]
async fn redaction_changes_what_the_sink_sees_not_the_answer() {
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

// PEER-CASES G3
#[tokio::test]
async fn hold_release_releases_the_original_tokens_in_order_with_their_meta() {
    let tokens = vec![token("he", Some(r#"{"k":1}"#)), token("llo", None)];
    let (seen, answer) = held(json!({ "words": ["bomb"] }), tokens.clone()).await;
    assert_eq!(seen, tokens);
    assert_eq!(answer, "hello");
}

// PEER-CASES G4
#[tokio::test]
async fn hold_release_replaces_a_blocked_stream_with_one_token() {
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
