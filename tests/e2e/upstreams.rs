//! Several upstreams behind one route (`UpstreamPool`): weighted
//! balancing, failover before the first token, cooldown and recovery, in
//! the library and through a gateway whose upstream goes down under load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use shallot::types::ChatRequest;
use shallot::{
    ChainError, ChatModel, Context, ErrorKind, Gateway, Kernel, OpenAiConfig, OpenAiModel,
    PoolConfig, Route, UpstreamPool,
};
use shallot_tests::{Collector, Reply, ScriptedModel, ask};

use super::gateway::{Served, config};

/// Streams "hi" through `kernel`: the answer and the text streamed.
async fn stream(kernel: &Kernel) -> (Result<shallot::types::ChatResponse, ChainError>, String) {
    let sink = Collector::default();
    let answer = kernel
        .chat_stream(ask("hi"), Context::new(), sink.clone())
        .await;
    (answer, sink.tokens().concat())
}

/// A model that answers its `name`, or fails as `down` says.
fn member(name: &'static str, down: Arc<AtomicBool>, kind: ErrorKind) -> ScriptedModel {
    ScriptedModel::new(move |_, _: &ChatRequest| {
        if down.load(Ordering::SeqCst) {
            Reply::Fail(ChainError::new(kind, format!("{name} is down")))
        } else {
            Reply::Text(name.into())
        }
    })
}

/// What `pool` answers "hi" with.
async fn answer(pool: &UpstreamPool) -> String {
    pool.chat(&ask("hi"), &Context::new())
        .await
        .unwrap()
        .message
        .text()
}

fn resting(cool_after: u32, cooldown: Duration) -> UpstreamPool {
    UpstreamPool::new(PoolConfig {
        cool_after,
        cooldown,
    })
}

#[tokio::test]
async fn a_pool_balances_by_weight_and_fails_over_only_what_another_may_answer() {
    let (a_down, b_down) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (a, b) = (
        member("a", a_down.clone(), ErrorKind::Transient),
        member("b", b_down.clone(), ErrorKind::InvalidRequest),
    );
    let pool = resting(100, Duration::from_secs(60))
        .upstream("a", 3, a.clone())
        .upstream("b", 1, b.clone());
    let context = Context::new();
    let mut answers = Vec::new();
    for _ in 0..40 {
        let answer = pool.chat(&ask("hi"), &context).await.unwrap();
        answers.push(answer.message.text());
    }
    let from_a = answers.iter().filter(|a| *a == "a").count();
    assert_eq!((from_a, a.calls(), b.calls()), (30, 30, 10), "3 to 1");

    // a fails transiently: every request is b's, none fails.
    a_down.store(true, Ordering::SeqCst);
    for _ in 0..8 {
        let answer = pool.chat(&ask("hi"), &context).await.unwrap();
        assert_eq!(answer.message.text(), "b");
    }
    // b refuses the request itself: that is the answer, not tried on a.
    a_down.store(false, Ordering::SeqCst);
    b_down.store(true, Ordering::SeqCst);
    let a_before = a.calls();
    let mut refused = 0;
    for _ in 0..8 {
        if let Err(error) = pool.chat(&ask("hi"), &context).await {
            assert_eq!(error.kind, ErrorKind::InvalidRequest, "{error}");
            refused += 1;
        }
    }
    assert_eq!(refused, 2, "b's share is refused, and only that");
    assert_eq!(a.calls() - a_before, 6);
    let health = pool.upstreams();
    assert_eq!(health[0].failures, 6, "{health:?}");
    assert!(
        health.iter().all(|h| h.healthy && h.resting.is_none()),
        "{health:?}"
    );
}

/// An upstream of weight 0 is a standby: it answers only what the others
/// fail.
#[tokio::test]
async fn a_standby_upstream_answers_only_what_the_others_fail() {
    let down = Arc::new(AtomicBool::new(false));
    let main = member("main", down.clone(), ErrorKind::Transient);
    let spare = member(
        "spare",
        Arc::new(AtomicBool::new(false)),
        ErrorKind::Transient,
    );
    let pool = resting(100, Duration::from_secs(60))
        .upstream("spare", 0, spare.clone())
        .upstream("main", 1, main.clone());
    for _ in 0..5 {
        assert_eq!(answer(&pool).await, "main");
    }
    down.store(true, Ordering::SeqCst);
    assert_eq!(answer(&pool).await, "spare");
    assert_eq!((main.calls(), spare.calls()), (6, 1));
}

#[tokio::test]
async fn an_upstream_that_keeps_failing_rests_and_is_tried_again_after_its_cooldown() {
    let down = Arc::new(AtomicBool::new(true));
    let a = member("a", down.clone(), ErrorKind::Timeout);
    let b = member("b", Arc::default(), ErrorKind::Transient);
    let pool = resting(2, Duration::from_secs(3600))
        .upstream("a", 1, a.clone())
        .upstream("b", 1, b.clone());
    let context = Context::new();
    for _ in 0..10 {
        assert_eq!(answer(&pool).await, "b");
    }
    assert_eq!(a.calls(), 2, "a rests after two failures in a row");
    let health = &pool.upstreams()[0];
    assert!(!health.healthy && health.resting.is_some(), "{health:?}");
    assert_eq!(health.cooldowns, 1);

    // The same with a short cooldown: past it a is tried again, and one
    // success makes it healthy.
    let a = member("a", down.clone(), ErrorKind::Timeout);
    let pool = resting(2, Duration::from_millis(50))
        .upstream("a", 1, a.clone())
        .upstream("b", 1, b.clone());
    while a.calls() < 2 {
        assert_eq!(answer(&pool).await, "b");
    }
    down.store(false, Ordering::SeqCst);
    while a.calls() == 2 {
        pool.chat(&ask("hi"), &context).await.unwrap();
        tokio::task::yield_now().await;
    }
    let health = &pool.upstreams()[0];
    assert!(health.healthy && health.resting.is_none(), "{health:?}");

    // Every upstream resting: they are tried anyway.
    let both = resting(1, Duration::from_secs(60))
        .upstream(
            "a",
            1,
            member("a", Arc::new(AtomicBool::new(true)), ErrorKind::Transient),
        )
        .upstream(
            "b",
            1,
            member("b", Arc::new(AtomicBool::new(true)), ErrorKind::Transient),
        );
    assert!(both.chat(&ask("hi"), &context).await.is_err());
    assert!(both.upstreams().iter().all(|h| h.resting.is_some()));
    assert!(
        both.chat(&ask("hi"), &context).await.is_err(),
        "still an error, and no panic"
    );
}

#[tokio::test]
async fn a_stream_fails_over_before_its_first_token_and_not_after() {
    let broken = ScriptedModel::replies(vec![
        Reply::Fail(ChainError::new(ErrorKind::Transient, "refused")),
        Reply::BreakAfter(
            vec!["half".into()],
            ChainError::new(ErrorKind::Transient, "reset"),
        ),
    ]);
    let whole = ScriptedModel::answer("whole");
    let pool = resting(10, Duration::from_secs(60))
        .upstream("broken", 1, broken)
        .upstream("whole", 1, whole.clone());
    let kernel = Kernel::builder().model(pool).build().unwrap();
    let (first, _) = stream(&kernel).await;
    assert_eq!(first.unwrap().message.text(), "whole", "failed over");
    // The next request starts on "whole" (round robin) and answers.
    let (second, _) = stream(&kernel).await;
    assert!(second.is_ok());
    // Then "broken" streams a token and breaks: no failover after it.
    let (third, text) = stream(&kernel).await;
    assert!(third.is_err(), "a broken stream is an error");
    assert_eq!(text, "half");
    assert_eq!(whole.calls(), 2);
}

/// A gateway route over two upstreams (each a gateway over the embedded
/// model): one is stopped during a load run of JSON and streamed
/// requests, and no request fails (the stopped one drains those it
/// started, and a stream fails over before its first token); the
/// stopped one rests, is seen resting in `/metrics` and `/readyz`, and
/// once it is back is seen healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_over_two_upstreams_loses_no_request_when_one_goes_down() {
    let upstream = || {
        Gateway::new(
            vec![Route::proxy("echo", Kernel::builder().build().unwrap())],
            config(),
        )
    };
    let a = Served::gateway(upstream()).await;
    let b = Served::gateway(upstream()).await;
    let a_address = a.base.trim_start_matches("http://").to_owned();
    let server = |base: &str| {
        let config = OpenAiConfig {
            max_retries: 0,
            ..OpenAiConfig::new(format!("{base}/v1"), "echo")
        };
        OpenAiModel::new(config).unwrap()
    };
    let pool = resting(1, Duration::from_millis(200))
        .upstream("a", 1, server(&a.base))
        .upstream("b", 1, server(&b.base));
    let kernel = Kernel::builder().model(pool).build().unwrap();
    let served =
        Served::gateway(Gateway::new(vec![Route::proxy("pooled", kernel)], config())).await;

    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let load: Vec<_> = (0..4)
        .map(|n| {
            let url = format!("{}/v1/chat/completions", served.base);
            let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                // Half the clients stream.
                let stream = n % 2 == 1;
                while !stop.load(Ordering::SeqCst) {
                    let body = json!({ "model": "pooled", "stream": stream, "messages": [{ "role": "user", "content": format!("client {n}") }] });
                    let response = client.post(&url).json(&body).send().await.unwrap();
                    let status = response.status().as_u16();
                    let body = response.text().await.unwrap();
                    let whole = if stream {
                        body.contains("data: [DONE]") && !body.contains("\"error\"")
                    } else {
                        serde_json::from_str::<Value>(&body)
                            .is_ok_and(|b| b["choices"][0]["message"]["content"].is_string())
                    };
                    if status == 200 && whole {
                        answered.fetch_add(1, Ordering::SeqCst);
                    } else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        eprintln!("failed: {status} {body}");
                    }
                }
            })
        })
        .collect();
    let reached = |count: usize| {
        let answered = answered.clone();
        async move {
            while answered.load(Ordering::SeqCst) < count {
                tokio::task::yield_now().await;
            }
        }
    };
    reached(40).await;
    a.stop().await.unwrap();
    let metrics = |served: &Served| {
        let served = served.base.clone();
        async move {
            reqwest::get(format!("{served}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    let cooled = r#"shallot_gateway_upstream_cooldowns_total{model="pooled",upstream="a"}"#;
    loop {
        let text = metrics(&served).await;
        if text
            .lines()
            .any(|l| l.starts_with(cooled) && !l.ends_with(" 0"))
        {
            break;
        }
        tokio::task::yield_now().await;
    }
    // (An answer a gave while it drained may still have been counted as
    // its success after its first failure; forty answers later, not.)
    let at_stop = answered.load(Ordering::SeqCst);
    reached(at_stop + 40).await;
    let text = metrics(&served).await;
    assert!(
        text.contains(r#"shallot_gateway_upstream_healthy{model="pooled",upstream="a"} 0"#),
        "{text}"
    );
    let (_, ready) = served.get("/readyz").await;
    let ready: Value = serde_json::from_str(&ready).unwrap();
    let upstreams = &ready["routes"][0]["upstreams"];
    assert_eq!(upstreams[0]["name"], "a", "{ready}");
    assert_eq!(upstreams[0]["healthy"], false, "{ready}");

    // a comes back on its address: past its cooldown it is tried, and healthy.
    let a = Served::at(upstream(), &a_address).await;
    let healthy = r#"shallot_gateway_upstream_healthy{model="pooled",upstream="a"} 1"#;
    while !metrics(&served).await.lines().any(|l| l == healthy) {
        tokio::task::yield_now().await;
    }
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::SeqCst), 0, "no request failed");
    assert!(answered.load(Ordering::SeqCst) >= at_stop + 40);
    for gateway in [served, a, b] {
        gateway.stop().await.unwrap();
    }
}

/// `upstreams` in a `[[route]]`: the route balances them (its `/readyz`
/// lists each), and what cannot be meant is refused with the reason.
#[tokio::test]
async fn a_config_names_a_routes_upstreams_and_what_cannot_be_meant_is_refused() {
    let dir = shallot_tests::target_dir()
        .join("test-scratch")
        .join("upstreams");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let read = |route: &str| {
        std::fs::write(&file, format!("[[route]]\nmodel = \"pooled\"\n{route}")).unwrap();
        shallot::Config::read(&file).and_then(|config| config.routes().map(|_| config))
    };
    let config = read(
        "upstreams = [\n  { base_url = \"http://127.0.0.1:9/v1\", model = \"m\", weight = 3 },\n  \
         { base_url = \"http://127.0.0.1:10/v1\", model = \"m\", name = \"spare\" },\n  \
         { api = \"anthropic\", base_url = \"http://127.0.0.1:11/v1\", model = \"claude\", max_tokens = 1024 },\n]\n\
         cooldown_ms = 500\n",
    )
    .unwrap();
    let plugins = shallot_tests::load(vec![]).await;
    let routes = shallot::Serving::from_config(Some(&config), &plugins, None)
        .await
        .unwrap()
        .routes;
    let served = Served::gateway(Gateway::new(routes, super::gateway::config())).await;
    let (_, ready) = served.get("/readyz").await;
    let ready: Value = serde_json::from_str(&ready).unwrap();
    let upstreams = &ready["routes"][0]["upstreams"];
    assert_eq!(upstreams[0]["name"], "m@http://127.0.0.1:9/v1", "{ready}");
    assert_eq!(upstreams[0]["weight"], 3);
    assert_eq!(upstreams[1]["name"], "spare");
    assert_eq!(upstreams[1]["healthy"], true);
    assert_eq!(upstreams[2]["name"], "claude@http://127.0.0.1:11/v1");
    served.stop().await.unwrap();

    let server = "{ base_url = \"http://127.0.0.1:9/v1\", model = \"m\" }";
    for (route, said) in [
        (
            format!("upstream = {server}\nupstreams = [{server}]\n"),
            "not both",
        ),
        (
            format!("upstreams = [{server}, {server}]\n"),
            "two upstreams are named",
        ),
        ("upstreams = []\n".to_owned(), "is empty"),
        (
            format!("upstream = {server}\ncooldown_ms = 5\n"),
            "go with `upstreams`",
        ),
        (
            "upstreams = [{ base_url = \"http://a/v1\", model = \"m\", wieght = 2 }]\n".to_owned(),
            "wieght",
        ),
        (
            "upstream = { base_url = \"http://a/v1\", model = \"m\", weight = 2 }\n".to_owned(),
            "go with `upstreams`",
        ),
        (
            "upstreams = [{ base_url = \"http://a/v1\", model = \"m\", max_tokens = 9 }]\n"
                .to_owned(),
            "`max_tokens` is for",
        ),
    ] {
        let Err(error) = read(&route) else {
            panic!("{route} is refused");
        };
        assert!(error.to_string().contains(said), "{route}: {error}");
    }
}
