//! System prompts: the caller's, one system message each, or shaped by the
//! filters' system-prompt hooks in filter order into one; applied innermost
//! and never stored in history.

use serde_json::json;
use shallot::types::Role;
use shallot::{Context, InvokeOptions, Kernel};
use shallot_tests::{Reply, ScriptedModel, load, spec};

use crate::agent::{add_tool, done, go, texts};

#[tokio::test]
async fn system_prompts_are_the_innermost_layer_and_never_stored() {
    let plugins = load(vec![spec(
        "probe",
        "rag",
        json!({ "system": "CONTEXT", "hooks": ["chat"] }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 1})),
        Reply::Text("2".into()),
    ]);
    let kernel = add_tool(Kernel::builder().plugins(&plugins))
        .model(model.clone())
        .build()
        .unwrap();
    let options = InvokeOptions::from(Context::new().with("conversation_id", "sys"))
        .system_prompt("You are terse.")
        .system_prompt("Answer in digits.");
    let done = done(kernel.turn(go("1+1"), options).await);
    for request in model.requests() {
        assert_eq!(
            texts(&request.messages)[..3],
            ["You are terse.", "Answer in digits.", "CONTEXT"],
            "every round, after the filters, one system message each (§2.3)"
        );
        let roles: Vec<Role> = request.messages[..2].iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::System]);
    }
    assert!(
        done.messages.iter().all(|m| m.role != Role::System),
        "the run's messages have no system prompt"
    );
}

#[tokio::test]
async fn system_prompt_hooks_shape_the_prompt_in_filter_order() {
    let plugins = load(vec![
        spec(
            "probe",
            "first",
            json!({ "append_system": "Be brief.", "hooks": ["system-prompt"] }),
        ),
        spec(
            "probe",
            "second",
            json!({ "append_system": "Cite sources.", "hooks": ["system-prompt"] }),
        ),
    ])
    .await;
    let model = ScriptedModel::answer("ok");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let options = InvokeOptions::from(Context::new()).system_prompt("You are X.");
    kernel
        .chat(shallot_tests::ask("hi"), options)
        .await
        .unwrap();
    assert_eq!(
        model.requests()[0].messages[0].text(),
        "You are X.\nBe brief.\nCite sources."
    );
    kernel
        .chat(shallot_tests::ask("hi"), Context::new())
        .await
        .unwrap();
    assert_eq!(
        model.requests()[1].messages[0].text(),
        "Be brief.\nCite sources.",
        "filters may add a prompt of their own"
    );
}
