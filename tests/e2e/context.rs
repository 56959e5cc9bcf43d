//! The shared context: one per invoke, seen by every filter, the terminal
//! and the caller (PEER-CASES D, adapted to a context handle).

use serde_json::json;
use shallot::types::ToolSpec;
use shallot::{Context, Kernel};
use shallot_tests::{load, spec, strings};

#[tokio::test]
async fn what_the_caller_sets_filters_and_the_terminal_see_and_what_they_write_the_caller_sees() {
    let plugins = load(vec![spec(
        "probe",
        "p",
        json!({ "tag": "p", "echo_id": true }),
    )])
    .await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(
            ToolSpec::new("read", "", json!({"type": "object"})),
            |_, context: Context| async move {
                Ok(json!({ "id": context.get("id"), "trace": context.get("trace") }))
            },
        )
        .build()
        .unwrap();
    let context = Context::new().with("id", 7);
    let result = kernel
        .tool("read", json!({}), context.clone())
        .await
        .unwrap();
    assert_eq!(
        result.value().unwrap(),
        json!({ "id": 7, "trace": ["p_before"] }),
        "the terminal saw the caller's and the filter's values"
    );
    assert_eq!(strings(&context, "trace"), ["p_before", "p_after"]);
    assert_eq!(context.get("fctx:p"), Some(json!({ "id": 7 })));
}

#[tokio::test]
async fn invokes_do_not_share_a_context() {
    let plugins = load(vec![spec("probe", "p", json!({ "tag": "p" }))]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .tool(ToolSpec::new("t", "", json!({})), |_, _| async {
            Ok(json!(1))
        })
        .build()
        .unwrap();
    let (first, second) = (Context::new(), Context::new());
    kernel.tool("t", json!({}), first.clone()).await.unwrap();
    kernel.tool("t", json!({}), second.clone()).await.unwrap();
    assert_eq!(strings(&first, "trace"), ["p_before", "p_after"]);
    assert_eq!(strings(&second, "trace"), ["p_before", "p_after"]);
}

#[test]
fn d2_context_keys_are_sorted_and_values_replace() {
    let context = Context::new().with("b", 2).with("a", 1);
    context.set("b", 3);
    assert_eq!(context.keys(), ["a", "b"]);
    assert_eq!(context.get("b"), Some(json!(3)));
    context.remove("a");
    assert_eq!(context.get("a"), None);
}
