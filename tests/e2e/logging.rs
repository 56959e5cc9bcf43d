//! The logging filter through the real host (PEER-CASES I1): it joins the
//! chat, tool and turn chains and passes each call through unchanged.

use serde_json::{Value, json};
use shallot::types::ToolSpec;
use shallot::{Context, Kernel};
use shallot_tests::{ScriptedModel, ask, load, spec};

// PEER-CASES I1
#[tokio::test]
async fn logging_passes_everything_through() {
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
