//! The memory filter and the conversation stores behind its `memory`
//! import: PEER-CASES M (store, window, before-step, integration), no
//! duplicates through tool rounds and re-entries, and each store (in
//! process, SQLite, a real Redis that goes away mid-run and comes back).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use shallot::types::{ChatRequest, Decision, Message, Role, ToolSpec, TurnRequest, TurnResult};
use shallot::{
    Context, ErrorKind, FilterSpec, Grants, Kernel, Limits, LoadError, LoopConfig, NoHistory,
    ToolLoop, open_store,
};
use shallot_tests::{RedisServer, Reply, ScriptedModel, load, spec};

use crate::agent::{done, go, texts};

/// A conversation id no other test uses.
fn conversation(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

fn memory_filter(config: Value, store: &str) -> (PathBuf, FilterSpec) {
    let (path, spec) = spec("memory", "memory", config);
    let grants = Grants {
        memory: Some(store.into()),
        ..Grants::default()
    };
    (path, FilterSpec { grants, ..spec })
}

/// A kernel with `filters` over `model`, its tool loop without history of
/// its own (the memory filter keeps it), and an `echo` tool.
async fn kernel(filters: Vec<(PathBuf, FilterSpec)>, model: ScriptedModel) -> Kernel {
    let plugins = load(filters).await;
    Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(
            ToolSpec::new("echo", "", json!({ "type": "object" })),
            |args: Value, _| async move { Ok(args) },
        )
        .turn_terminal(ToolLoop::new(LoopConfig::default(), NoHistory))
        .build()
        .unwrap()
}

/// What the in-process store holds of conversation `c`.
async fn stored(c: &str) -> Vec<Message> {
    open_store(":memory:")
        .await
        .unwrap()
        .load(c, usize::MAX)
        .await
        .unwrap()
}

fn roles(messages: &[Message]) -> Vec<Role> {
    messages.iter().map(|m| m.role).collect()
}

/// PEER-CASES M1 on one store.
async fn conversations_keep_order_and_stay_apart_on(store: &str) {
    let store = open_store(store).await.unwrap();
    let (c1, c2) = (conversation("m1"), conversation("m1-other"));
    assert!(store.load(&c1, usize::MAX).await.unwrap().is_empty());
    store.append(&c1, &[Message::user("M1")]).await.unwrap();
    store
        .append(&c1, &[Message::assistant("M2")])
        .await
        .unwrap();
    assert_eq!(
        texts(&store.load(&c1, usize::MAX).await.unwrap()),
        ["M1", "M2"]
    );
    assert!(
        store.load(&c2, usize::MAX).await.unwrap().is_empty(),
        "conversations are separate"
    );
    store.clear(&c1).await.unwrap();
    assert!(store.load(&c1, usize::MAX).await.unwrap().is_empty());
    // A load reads the latest messages that fit in its bytes, no more.
    let (old, new) = ("o".repeat(1000), "n".repeat(1000));
    store.append(&c1, &[Message::user(&old)]).await.unwrap();
    store
        .append(&c1, &[Message::assistant(&new)])
        .await
        .unwrap();
    assert_eq!(texts(&store.load(&c1, 1500).await.unwrap()), [new]);
    assert!(store.load(&c1, 10).await.unwrap().is_empty());
    assert_eq!(store.load(&c1, 4000).await.unwrap().len(), 2);
    store.clear(&c1).await.unwrap();
}

fn sqlite_file(name: &str) -> String {
    let dir = shallot_tests::target_dir()
        .join("test-scratch")
        .join("memory");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path.display().to_string()
}

// PEER-CASES M1
#[tokio::test]
async fn every_store_keeps_conversations_in_order_and_apart() {
    conversations_keep_order_and_stay_apart_on(":memory:").await;
    conversations_keep_order_and_stay_apart_on(&sqlite_file("m1")).await;
    let redis = RedisServer::start();
    conversations_keep_order_and_stay_apart_on(&redis.url()).await;
}

// PEER-CASES M9
#[tokio::test]
async fn the_model_sees_the_stored_history_and_the_reply_is_stored() {
    let store = open_store(":memory:").await.unwrap();
    let c = conversation("m9");
    store.append(&c, &[Message::user("Old")]).await.unwrap();
    let model = ScriptedModel::answer("reply");
    let kernel = kernel(vec![memory_filter(Value::Null, ":memory:")], model.clone()).await;
    let request = ChatRequest::new(vec![Message::user("New")]);
    kernel
        .chat(request, Context::new().with("conversation_id", c.as_str()))
        .await
        .unwrap();
    assert_eq!(texts(&model.requests()[0].messages), ["Old", "New"]);
    assert_eq!(
        texts(&store.load(&c, usize::MAX).await.unwrap()),
        ["Old", "New", "reply"]
    );
}

// PEER-CASES M10
#[tokio::test]
async fn without_a_conversation_id_it_passes_through_and_stores_nothing() {
    let model = ScriptedModel::answer("reply");
    let kernel = kernel(vec![memory_filter(Value::Null, ":memory:")], model.clone()).await;
    kernel
        .chat(ChatRequest::new(vec![Message::user("New")]), Context::new())
        .await
        .unwrap();
    assert_eq!(texts(&model.requests()[0].messages), ["New"]);
}

// PEER-CASES M2, M3
#[tokio::test]
async fn the_window_keeps_system_messages_and_drops_orphan_tool_results() {
    let store = open_store(":memory:").await.unwrap();
    let model = ScriptedModel::answer("ok");
    let filter = memory_filter(json!({ "window": 2 }), ":memory:");
    let kernel = kernel(vec![filter], model.clone()).await;
    // What the model sees of a conversation holding `stored`, asked "U2".
    let sees = async |stored: Vec<Message>| {
        let c = conversation("window");
        store.append(&c, &stored).await.unwrap();
        let context = Context::new().with("conversation_id", c.as_str());
        let request = ChatRequest::new(vec![Message::user("U2")]);
        kernel.chat(request, context).await.unwrap();
        let seen = texts(&model.requests().last().unwrap().messages);
        (seen, store.load(&c, usize::MAX).await.unwrap().len())
    };
    let m2 = vec![
        Message::system("Sys"),
        Message::user("U1"),
        Message::assistant("A1"),
    ];
    assert_eq!(
        sees(m2).await,
        (vec!["Sys".into(), "A1".into(), "U2".into()], 5),
        "the store keeps all"
    );
    let m3 = vec![
        Message::assistant("A1"),
        Message::tool_result("t1", "\"T1\""),
    ];
    assert_eq!(sees(m3).await.0, ["U2"]);
}

// PEER-CASES M12
#[tokio::test]
async fn turns_across_invokes_see_the_conversation_grow() {
    let model = ScriptedModel::new(|_, request: &ChatRequest| {
        Reply::Text(format!("saw:{}", request.messages.len()))
    });
    let kernel = kernel(vec![memory_filter(Value::Null, ":memory:")], model.clone()).await;
    let c = conversation("m12");
    let context = || Context::new().with("conversation_id", c.as_str());
    assert_eq!(
        done(kernel.turn(go("hi"), context()).await).response.text(),
        "saw:1"
    );
    assert_eq!(
        done(kernel.turn(go("bye"), context()).await)
            .response
            .text(),
        "saw:3"
    );
    let stored = stored(&c).await;
    assert_eq!(
        roles(&stored),
        [Role::User, Role::Assistant, Role::User, Role::Assistant]
    );
}

#[tokio::test]
async fn a_tool_round_is_stored_once_in_order() {
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({ "x": 1 })),
        Reply::Text("answer".into()),
    ]);
    let kernel = kernel(vec![memory_filter(Value::Null, ":memory:")], model.clone()).await;
    let c = conversation("tools");
    done(
        kernel
            .turn(go("q"), Context::new().with("conversation_id", c.as_str()))
            .await,
    );
    let stored = stored(&c).await;
    assert_eq!(
        roles(&stored),
        [Role::User, Role::Assistant, Role::Tool, Role::Assistant]
    );
    assert_eq!(roles(&model.requests()[1].messages), roles(&stored[..3]));
}

#[tokio::test]
async fn a_validation_reentry_stores_nothing_twice() {
    let validation = spec(
        "validation",
        "validation",
        json!({ "required": ["good"], "max_retries": 2 }),
    );
    let model = ScriptedModel::replies(vec![Reply::Text("bad".into()), Reply::Text("good".into())]);
    let kernel = kernel(
        vec![validation, memory_filter(Value::Null, ":memory:")],
        model.clone(),
    )
    .await;
    let c = conversation("reentry");
    done(
        kernel
            .turn(
                go("MY-QUESTION"),
                Context::new().with("conversation_id", c.as_str()),
            )
            .await,
    );
    let stored = texts(&stored(&c).await);
    assert_eq!(stored.len(), 4, "{stored:?}");
    assert_eq!(
        (stored[0].as_str(), stored[1].as_str(), stored[3].as_str()),
        ("MY-QUESTION", "bad", "good")
    );
    assert!(stored[2].contains("did not pass validation"));
    let second = texts(&model.requests()[1].messages);
    assert_eq!(
        second.iter().filter(|t| *t == "MY-QUESTION").count(),
        1,
        "{second:?}"
    );
}

#[tokio::test]
async fn a_sqlite_store_outlives_the_filters_that_used_it() {
    let file = sqlite_file("outlives");
    let c = conversation("sqlite");
    let context = || Context::new().with("conversation_id", c.as_str());
    {
        let kernel = kernel(
            vec![memory_filter(Value::Null, &file)],
            ScriptedModel::answer("first answer"),
        )
        .await;
        done(kernel.turn(go("first"), context()).await);
    }
    let model = ScriptedModel::answer("second answer");
    let kernel = kernel(vec![memory_filter(Value::Null, &file)], model.clone()).await;
    done(kernel.turn(go("second"), context()).await);
    assert_eq!(
        texts(&model.requests()[0].messages),
        ["first", "first answer", "second"]
    );
}

#[tokio::test]
async fn two_hosts_share_conversations_through_redis_which_may_go_away_and_come_back() {
    let mut redis = RedisServer::start();
    let c = conversation("redis");
    let context = || Context::new().with("conversation_id", c.as_str());
    let first = kernel(
        vec![memory_filter(Value::Null, &redis.url())],
        ScriptedModel::answer("one"),
    )
    .await;
    done(first.turn(go("hello"), context()).await);
    // Another engine stands in for another process on another machine.
    let engine = shallot::Engine::new(shallot::EngineConfig::default()).unwrap();
    let plugins =
        shallot_tests::load_in(&engine, vec![memory_filter(Value::Null, &redis.url())]).await;
    let model = ScriptedModel::answer("two");
    let second = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .turn_terminal(ToolLoop::new(LoopConfig::default(), NoHistory))
        .build()
        .unwrap();
    done(second.turn(go("again"), context()).await);
    assert_eq!(
        texts(&model.requests()[0].messages),
        ["hello", "one", "again"]
    );

    redis.stop();
    let started = std::time::Instant::now();
    let result = second.turn(go("anyone?"), context()).await;
    let shallot::types::TurnResult::Error(error) = result else {
        panic!("{result:?}")
    };
    assert_eq!(error.kind, ErrorKind::Transient, "{error}");
    assert!(error.message.contains("conversation store"), "{error}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "bounded, never a hang"
    );

    redis.resume();
    // Until the client has reconnected (within a minute).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut back = None;
    while back.is_none() && std::time::Instant::now() < deadline {
        if let shallot::types::TurnResult::Done(done) = second.turn(go("back"), context()).await {
            back = Some(done);
        } else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    back.expect("the store works again once Redis is back");
}

#[tokio::test]
async fn a_store_that_cannot_be_opened_fails_the_load_with_a_clear_error() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    for (store, says) in [
        (
            "/nonexistent-dir/conversations.db".to_owned(),
            "cannot open the SQLite file /nonexistent-dir/conversations.db",
        ),
        (
            format!("redis://127.0.0.1:{closed}/0"),
            "cannot reach redis at 127.0.0.1",
        ),
        ("redis://[bad".to_owned(), "not a Redis URL"),
    ] {
        let specs = vec![memory_filter(Value::Null, &store)];
        let error = shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
            .await
            .err()
            .expect("refused");
        assert!(matches!(error, LoadError::Config { .. }), "{error}");
        assert!(error.to_string().contains(says), "{store}: {error}");
    }
}

#[tokio::test]
async fn memory_without_its_grant_fails_the_call_naming_the_grant() {
    let kernel = kernel(
        vec![spec("memory", "memory", Value::Null)],
        ScriptedModel::answer("x"),
    )
    .await;
    let error = kernel
        .chat(
            ChatRequest::new(vec![Message::user("hi")]),
            Context::new().with("conversation_id", "c"),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind, ErrorKind::Auth, "{error}");
    assert!(error.message.contains("memory"), "{error}");
}

#[tokio::test]
async fn memory_refuses_a_bad_configuration_at_load() {
    for (config, says) in [
        (json!({ "window": 0 }), "window"),
        (json!({ "windw": 3 }), "unknown field"),
    ] {
        let error = crate::loading::refused("memory", "memory", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

// PEER-CASES H16
/// A turn paused for approval and resumed is one turn to the memory
/// filter: the resumed turn goes on from its count of what it stored, so
/// the question and the calls are stored once (H16 across a pause), and
/// the model's second call sees the question once.
#[tokio::test]
async fn a_resumed_turn_stores_nothing_twice() {
    let c = conversation("resumed");
    let model = ScriptedModel::replies(vec![
        Reply::Calls(vec![
            ("delete".into(), json!({})),
            ("echo".into(), json!({ "x": 1 })),
        ]),
        Reply::Text("Done.".into()),
    ]);
    let plugins = load(vec![memory_filter(Value::Null, ":memory:")]).await;
    let config = LoopConfig {
        pause_sensitive: true,
        ..LoopConfig::default()
    };
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .tool(
            ToolSpec::new("delete", "", json!({})).sensitive(),
            |_, _| async { Ok(json!("deleted")) },
        )
        .tool(
            ToolSpec::new("echo", "", json!({})),
            |args: Value, _| async move { Ok(args) },
        )
        .turn_terminal(ToolLoop::new(config, NoHistory))
        .build()
        .unwrap();
    let context = || Context::new().with("conversation_id", c.as_str());
    let request = TurnRequest::new(vec![Message::user("MY-QUESTION")]);
    let TurnResult::Interrupt(paused) = kernel.turn(request, context()).await else {
        panic!("the turn pauses for delete")
    };
    let TurnResult::Done(done) = kernel.resume(paused, Decision::Approve, context()).await else {
        panic!("the resumed turn ends")
    };
    assert_eq!(done.response.text(), "Done.");
    let history = stored(&c).await;
    let asked = |messages: &[Message]| {
        messages
            .iter()
            .filter(|m| m.text() == "MY-QUESTION")
            .count()
    };
    assert_eq!(asked(&history), 1, "{history:?}");
    assert_eq!(
        roles(&history),
        [
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Tool,
            Role::Assistant
        ],
        "{history:?}"
    );
    assert_eq!(asked(&model.requests()[1].messages), 1);
}

/// A conversation larger than the filter's host memory cap still loads:
/// the filter gets its latest messages that fit, whatever form the store
/// keeps them in (a SQLite row weighs less than the message in the host).
#[tokio::test]
async fn a_conversation_over_the_cap_loads_its_latest_messages() {
    let file = sqlite_file("over-the-cap");
    let store = open_store(file.as_str()).await.unwrap();
    let c = conversation("over-the-cap");
    let many: Vec<Message> = (0..12_000)
        .map(|i| Message::user(format!("{i:0>100}")))
        .collect();
    // A thousand at a time: each append is one operation within the
    // store's two seconds, however busy the machine.
    for chunk in many.chunks(1000) {
        store.append(&c, chunk).await.unwrap();
    }
    let (path, mut spec) = memory_filter(Value::Null, &file);
    // Thousands of messages through the guest: time is not what this
    // bounds (a debug build on a busy machine is slow).
    spec.limits = Limits {
        host_mib: 1,
        cpu_ms: 10_000,
        wall_ms: 10_000,
        ..Limits::default()
    };
    let model = ScriptedModel::answer("ok");
    let kernel = kernel(vec![(path, spec)], model.clone()).await;
    let request = ChatRequest::new(vec![Message::user("newest")]);
    kernel
        .chat(request, Context::new().with("conversation_id", c.as_str()))
        .await
        .unwrap();
    let seen = &model.requests()[0].messages;
    assert!(seen.len() > 1000 && seen.len() < 10_000, "{}", seen.len());
    assert_eq!(seen.last().unwrap().text(), "newest");
}
