//! Named presets of the built-in filters, as the first seed's middleware
//! presets (`beamai_middleware_presets`): a `[[filter]]` table with only
//! `preset = "NAME"` stands for its filters, in its place, outermost first
//! in the seed's priority order (call-limit, approval, tool-retry,
//! model-retry).

use serde_json::{Value, json};

use crate::plugin::{FilterSpec, Grants};

/// The presets' names, each with what it is for.
pub const PRESETS: [(&str, &str); 5] = [
    ("minimal", "call-limit"),
    ("default", "call-limit, model-retry"),
    (
        "production",
        "call-limit (15 model calls, halt), tool-retry (2 retries, 500 ms to 10 s), model-retry (2 retries)",
    ),
    (
        "development",
        "call-limit (50 model calls, warn), tool-retry (5 retries)",
    ),
    (
        "human_in_loop",
        "call-limit, approval of every tool call (asks the approval handler)",
    ),
];

/// How long a retrying filter of a preset may wait in all, per call.
const RETRY_WAIT_MS: u32 = 30_000;

/// One filter of a preset: its plugin file, its configuration and grants.
fn filter(plugin: &str, config: Value, grants: Grants) -> (String, FilterSpec) {
    let spec = FilterSpec {
        config: Some(config),
        grants,
        ..FilterSpec::default()
    };
    (plugin.to_owned(), spec)
}

fn call_limit(max_model_calls: u32, on_limit: &str) -> (String, FilterSpec) {
    let config = json!({ "max_model_calls": max_model_calls, "on_limit": on_limit });
    filter("call_limit.wasm", config, Grants::default())
}

fn retry(plugin: &str, config: Value) -> (String, FilterSpec) {
    let grants = Grants {
        sleep_ms: RETRY_WAIT_MS,
        ..Grants::default()
    };
    filter(plugin, config, grants)
}

/// The filters of preset `name` (plugin files, relative to the plugin
/// directory, with their specs), or `None` for a name that is not one.
pub fn preset(name: &str) -> Option<Vec<(String, FilterSpec)>> {
    let filters = match name {
        "minimal" => vec![call_limit(20, "halt")],
        "default" => vec![call_limit(20, "halt"), retry("model_retry.wasm", json!({}))],
        "production" => vec![
            call_limit(15, "halt"),
            retry(
                "tool_retry.wasm",
                json!({ "max_retries": 2, "initial_delay_ms": 500, "max_delay_ms": 10_000 }),
            ),
            retry("model_retry.wasm", json!({ "max_retries": 2 })),
        ],
        "development" => vec![
            call_limit(50, "warn"),
            retry("tool_retry.wasm", json!({ "max_retries": 5 })),
        ],
        "human_in_loop" => {
            let grants = Grants {
                approval: true,
                ..Grants::default()
            };
            let approval = json!({ "tools": "all", "default": "ask" });
            vec![
                call_limit(20, "halt"),
                filter("approval.wasm", approval, grants),
            ]
        }
        _ => return None,
    };
    Some(filters)
}

/// The names of the presets, for an error.
pub(super) fn names() -> String {
    let names: Vec<&str> = PRESETS.iter().map(|(name, _)| *name).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_preset_has_filters_and_no_other_name_does() {
        for (name, _) in PRESETS {
            assert!(!preset(name).unwrap().is_empty(), "{name}");
        }
        assert!(preset("prod").is_none());
    }
}
