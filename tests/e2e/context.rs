//! The shared context: one per invoke, seen by every filter, the terminal
//! and the caller (PEER-CASES D, adapted to a context handle), and how a
//! batch's tool writes fold into it (D5–D10, O30–O32).

use serde_json::{Value, json};
use shallot::types::{ToolSpec, TurnResult};
use shallot::{Context, Kernel, LoopConfig, NoHistory, Reducers, ToolLoop};
use shallot_tests::{Reply, ScriptedModel, load, spec, strings};

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

// PEER-CASES D2
#[test]
fn context_keys_are_sorted_and_values_replace() {
    let context = Context::new().with("b", 2).with("a", 1);
    context.set("b", 3);
    assert_eq!(context.keys(), ["a", "b"]);
    assert_eq!(context.get("b"), Some(json!(3)));
    context.remove("a");
    assert_eq!(context.get("a"), None);
}

/// A reducer that puts each write in front of the list so far (the
/// seed's `conj`).
fn prepend(list: Value, write: Value) -> Value {
    let mut list = match list {
        Value::Array(list) => list,
        _ => Vec::new(),
    };
    list.insert(0, write);
    Value::Array(list)
}

fn sum(total: Value, write: Value) -> Value {
    json!(total.as_i64().unwrap_or(0) + write.as_i64().unwrap_or(0))
}

/// What a call wrote.
fn writes(pairs: &[(&str, Value)]) -> Context {
    pairs
        .iter()
        .fold(Context::new(), |c, (k, v)| c.with(k, v.clone()))
}

// PEER-CASES D5, D6, D10
#[test]
fn writes_apply_by_index_and_report_conflicts() {
    let context = Context::new();
    let none = context.apply_writes(
        [(1, &Context::new()), (2, &Context::new())],
        &Reducers::new(),
    );
    assert!(none.is_empty() && context.keys().is_empty(), "D5");

    let (a, b) = (writes(&[("k", json!("a"))]), writes(&[("k", json!("b"))]));
    let conflicts = context.apply_writes([(2, &b), (1, &a)], &Reducers::new());
    assert_eq!(
        context.get("k"),
        Some(json!("b")),
        "D6: by index, not input order"
    );
    assert_eq!(conflicts, ["k"]);

    let (x, y) = (writes(&[("x", json!(1))]), writes(&[("y", json!(2))]));
    assert!(
        context
            .apply_writes([(1, &x), (2, &y)], &Reducers::new())
            .is_empty(),
        "D10"
    );
}

// PEER-CASES D7, D8, D9
#[test]
fn declared_reducers_fold_every_write() {
    let reducers = Reducers::new()
        .with("notes", json!([]), prepend)
        .with("budget", json!(0), sum);
    let context = Context::new();
    let (a, b) = (
        writes(&[("notes", json!("a"))]),
        writes(&[("notes", json!("b"))]),
    );
    let conflicts = context.apply_writes([(1, &a), (2, &b)], &reducers);
    assert_eq!(context.get("notes"), Some(json!(["b", "a"])), "D7");
    assert!(conflicts.is_empty(), "a declared key has no conflict");

    let spends = [5, 7, 3].map(|n| writes(&[("budget", json!(n))]));
    context.apply_writes(spends.iter().enumerate(), &reducers);
    assert_eq!(context.get("budget"), Some(json!(15)), "D8");

    let counter = Reducers::new().with("n", json!(0), sum);
    let context = Context::new();
    context.apply_writes([(0, &writes(&[("n", json!(10))]))], &counter);
    context.apply_writes([(0, &writes(&[("n", json!(5))]))], &counter);
    assert_eq!(context.get("n"), Some(json!(15)), "D9: across calls");
}

// PEER-CASES O30, O31, O32
/// O30–O32: a batch's tool writes to a key with a reducer fold in call
/// order at the end of the batch, concurrent or one call at a time, to the
/// same state.
#[tokio::test]
async fn tool_writes_to_a_declared_key_fold_the_same_serial_or_parallel() {
    for parallel_tools in [true, false] {
        let model = ScriptedModel::replies(vec![
            Reply::Calls(vec![
                ("note".into(), json!({"text": "a", "ms": 40})),
                ("note".into(), json!({"text": "b", "ms": 0})),
            ]),
            Reply::Text("done".into()),
        ]);
        let config = LoopConfig {
            parallel_tools,
            ..LoopConfig::default()
        };
        let kernel = Kernel::builder()
            .model(model)
            .turn_terminal(ToolLoop::new(config, NoHistory))
            .reducer("notes", json!([]), prepend)
            .tool(
                ToolSpec::new("note", "takes a note", json!({})),
                |args: Value, context: Context| async move {
                    let ms = args["ms"].as_u64().unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                    context.set("notes", args["text"].clone());
                    Ok(json!("noted"))
                },
            )
            .build()
            .unwrap();
        let (result, context) = shallot_tests::turn_go(&kernel).await;
        assert!(matches!(result, TurnResult::Done(_)), "{result:?}");
        assert_eq!(
            context.get("notes"),
            Some(json!(["b", "a"])),
            "parallel: {parallel_tools}"
        );
    }
}
