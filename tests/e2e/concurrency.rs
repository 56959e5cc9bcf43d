//! Many invokes at once: each sees only its own FCtx and context, requests
//! wait for instance slots instead of failing, and no instance is entered
//! twice even when a filter nests in itself or runs for concurrent tools.

use std::time::Duration;

use futures::future::join_all;
use serde_json::json;
use shallot::types::{Message, ToolSpec, TurnResult};
use shallot::{BuildError, Context, Engine, EngineConfig, Kernel};
use shallot_tests::{Reply, ScriptedModel, ask, load, load_in, spec, target_dir};

fn counters() -> Vec<(std::path::PathBuf, shallot::FilterSpec)> {
    let counter = |tag: &&str| {
        spec(
            "probe",
            tag,
            json!({ "tag": tag, "count": true, "echo_id": true, "hooks": ["chat"] }),
        )
    };
    ["a", "b", "c"].iter().map(counter).collect()
}

async fn run_all(kernel: &Kernel, invokes: usize) {
    let runs = (0..invokes).map(|id| {
        let kernel = kernel.clone();
        async move {
            let context = Context::new().with("id", id);
            let response = kernel
                .chat(ask(&format!("request {id}")), context.clone())
                .await;
            (id, response, context)
        }
    });
    for (id, response, context) in join_all(runs).await {
        let response = response.unwrap_or_else(|e| panic!("invoke {id} failed: {e}"));
        assert_eq!(response.text(), "ok");
        for tag in ["a", "b", "c"] {
            assert_eq!(
                context.get(&format!("fctx:{tag}")),
                Some(json!({ "n": 1, "id": id })),
                "invoke {id}, filter {tag}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_invokes_through_three_filters_each_see_only_their_own_state() {
    let plugins = load(counters()).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok"))
        .build()
        .unwrap();
    run_all(&kernel, 1000).await;
}

fn small_engine(slots: u32) -> Engine {
    let config = EngineConfig {
        instance_slots: slots,
        idle_instances: 0,
        cache_dir: Some(target_dir().join("shallot-test-cache")),
        // The last of hundreds waits for all before it: however long a
        // busy machine takes, it waits rather than fails.
        queue_timeout: Duration::from_secs(600),
        ..EngineConfig::default()
    };
    Engine::new(config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_slot_is_busy_requests_wait_their_turn_instead_of_failing() {
    let engine = small_engine(6);
    let plugins = load_in(&engine, counters()).await;
    let slow = ScriptedModel::new(|_, _| {
        shallot_tests::Reply::Slow(Duration::from_millis(2), "ok".into())
    });
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(slow)
        .build()
        .unwrap();
    run_all(&kernel, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tool_calls_through_one_filter_never_share_an_instance() {
    // Two slots: the turn and its inner calls hold them all, so the three
    // concurrent tool calls must queue for the invoke's own instances.
    let engine = small_engine(2);
    let filter = spec(
        "probe",
        "t",
        json!({ "tag": "t", "count": true, "hooks": ["turn", "chat", "tool"] }),
    );
    let plugins = load_in(&engine, vec![filter]).await;
    let calls = (0..3)
        .map(|i| ("slow".to_owned(), json!({ "i": i })))
        .collect();
    let model = ScriptedModel::replies(vec![Reply::Calls(calls), Reply::Text("ok".into())]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(ToolSpec::new("slow", "", json!({})), |args, _| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(args)
        })
        .build()
        .unwrap();
    let (result, context) = shallot_tests::turn_go(&kernel).await;
    let TurnResult::Done(done) = result else {
        panic!("{result:?}")
    };
    let outputs: Vec<String> = done
        .messages
        .iter()
        .filter(|m| m.tool_call_id.is_some())
        .map(Message::text)
        .collect();
    assert_eq!(outputs, [r#"{"i":0}"#, r#"{"i":1}"#, r#"{"i":2}"#]);
    assert_eq!(
        shallot_tests::strings(&context, "trace")
            .iter()
            .filter(|t| *t == "t_before")
            .count(),
        6,
        "turn, two chats, three tools"
    );
}

#[tokio::test]
async fn a_kernel_that_could_never_get_its_instances_is_refused_at_build() {
    let engine = small_engine(2);
    let plugins = load_in(&engine, counters()).await;
    let error = Kernel::builder().plugins(&plugins).build().err().unwrap();
    assert!(
        matches!(error, BuildError::TooFewSlots { need: 3, have: 2 }),
        "{error}"
    );
}
