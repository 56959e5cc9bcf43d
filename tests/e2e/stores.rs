//! A shared store's failure as a gateway's client sees it: `503`
//! `store_unavailable`, worth retrying (`Retry-After`), in each API's own
//! shape, never the `502` `upstream` that blames the model server; and,
//! the store back, served again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shallot::types::ChatRequest;
use shallot::{
    CONVERSATION_HEADER, ChainError, ErrorKind, FilterSpec, Gateway, Grants, Kernel, Route,
    StoreSpec, open_kv,
};
use shallot_tests::{RedisServer, Reply, ScriptedModel, spec};

use super::gateway::{Served, config};

/// A request's status, `Retry-After` and body.
async fn post(served: &Served, path: &str, body: &Value) -> (u16, Option<String>, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", served.base))
        .header(CONVERSATION_HEADER, "shared-store")
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, retry, body)
}

/// Asks until it is served, the store back (its client reconnects within
/// a minute): every answer before is the store's `503`.
async fn served_again(served: &Served, path: &str, body: &Value) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _, answer) = post(served, path, body).await;
        if status == 200 {
            return;
        }
        assert_eq!(status, 503, "{answer}");
        assert!(Instant::now() < deadline, "not served again: {answer}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What `/readyz` says of `redis`: it says the replica is ready (every
/// replica shares the store), and how the store has answered lately.
async fn readyz(served: &Served, redis: &RedisServer) -> Value {
    let ready: Value = reqwest::get(format!("{}/readyz", served.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["ready"], true, "{ready}");
    let port = redis.url().rsplit(':').next().unwrap().replace("/0", "");
    let shown = format!("redis at 127.0.0.1:{port}");
    ready["stores"]
        .as_array()
        .and_then(|stores| stores.iter().find(|store| store["store"] == shown.as_str()))
        .unwrap_or_else(|| panic!("{shown} in {ready}"))
        .clone()
}

/// The same server's database 0 by another URL: a store of its own in
/// this process (stores are shared by what opens them), as another
/// replica's would be.
fn other_connection(redis: &RedisServer) -> String {
    let url = redis.url();
    url.strip_suffix("/0")
        .expect("a URL of database 0")
        .to_owned()
}

fn chat(text: &str) -> Value {
    json!({ "model": "scripted", "user": "dana", "messages": [{ "role": "user", "content": text }] })
}

fn messages(text: &str) -> Value {
    json!({ "model": "scripted", "max_tokens": 16, "messages": [{ "role": "user", "content": text }] })
}

/// Answers "fine", or fails as a model server does when asked to.
fn model() -> ScriptedModel {
    ScriptedModel::new(|_, request: &ChatRequest| {
        if request.messages.last().unwrap().text() == "break the provider" {
            Reply::Fail(ChainError::new(
                ErrorKind::Transient,
                "the model server broke",
            ))
        } else {
            Reply::Text("fine".into())
        }
    })
}

/// Each stateful filter over a Redis that goes away and comes back: the
/// rate limit (keys) and the memory (conversations).
#[tokio::test]
async fn a_filters_store_that_fails_is_a_503_store_unavailable_not_the_upstreams_502() {
    let mut redis = RedisServer::start();
    let store = || Some(StoreSpec::from(redis.url().as_str()));
    let limit = json!({ "requests": 1000, "window_s": 60, "by": "user" });
    let filters = [
        (
            spec("rate_limit", "limit", limit),
            Grants {
                kv: store().map(Into::into),
                ..Grants::default()
            },
        ),
        (
            spec("memory", "memory", json!(null)),
            Grants {
                memory: store(),
                ..Grants::default()
            },
        ),
    ];
    for ((path, filter), grants) in filters {
        let name = filter.name.clone().unwrap();
        let plugins = shallot_tests::load(vec![(path, FilterSpec { grants, ..filter })]).await;
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model())
            .build()
            .unwrap();
        let served = Served::start(kernel, config()).await;
        let (status, _, body) = post(&served, "/v1/chat/completions", &chat("hi")).await;
        assert_eq!(status, 200, "{name}: {body}");

        redis.stop();
        let (status, retry, body) = post(&served, "/v1/chat/completions", &chat("hi")).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (503, Some("store_unavailable")),
            "{name}: {body}"
        );
        assert_eq!(retry.as_deref(), Some("1"), "worth retrying soon");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("'{name}'")), "{message}");
        assert!(!message.contains("127.0.0.1"), "not where it is: {message}");
        let (status, _, body) = post(&served, "/v1/messages", &messages("hi")).await;
        assert_eq!(status, 503, "{name}: {body}");
        assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
        // Known down, it is not waited on: the requests fail at once but
        // one a second, which tries it again.
        let mut fast = None;
        for _ in 0..50 {
            let (status, _, body) = post(&served, "/v1/chat/completions", &chat("hi")).await;
            assert_eq!(status, 503, "{body}");
            let message = body["error"]["message"].as_str().unwrap().to_owned();
            if message.contains("asked again once a second") {
                fast = Some(message);
                break;
            }
        }
        let fast = fast.expect("a request failed without waiting on the store");
        assert!(fast.contains("has not answered for"), "{fast}");
        let ready = readyz(&served, &redis).await;
        assert_eq!(ready["up"], false, "{ready}");
        assert!(
            ready["error"].is_string() && ready["down_for_ms"].is_u64(),
            "{ready}"
        );

        redis.resume();
        served_again(&served, "/v1/chat/completions", &chat("hi")).await;
        let ready = readyz(&served, &redis).await;
        assert_eq!(ready["up"], true, "{ready}");
        assert!(ready.get("error").is_none(), "{ready}");
        let broken = chat("break the provider");
        let (status, _, body) = post(&served, "/v1/chat/completions", &broken).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (502, Some("upstream")),
            "{name}: the model server's failure is still its own: {body}"
        );
        served.stop().await.unwrap();
    }
}

/// The gateway's own store: a kept response asked for while the store is
/// down is a `503`, not "no such response".
#[tokio::test]
async fn kept_responses_in_a_store_that_fails_are_a_503_store_unavailable() {
    let mut redis = RedisServer::start();
    let store = open_kv(StoreSpec::from(redis.url().as_str()))
        .await
        .unwrap();
    let kernel = Kernel::builder().model(model()).build().unwrap();
    let route = Route {
        store: Some(Arc::clone(&store)),
        ..Route::proxy("scripted", kernel)
    };
    let served = Served::gateway(Gateway::new(vec![route], config())).await;
    let first = json!({ "model": "scripted", "input": "hi" });
    let (status, _, body) = post(&served, "/v1/responses", &first).await;
    assert_eq!(status, 200, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();

    redis.stop();
    let next = json!({ "model": "scripted", "input": "and?", "previous_response_id": id });
    let (status, retry, body) = post(&served, "/v1/responses", &next).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{body}"
    );
    assert_eq!(retry.as_deref(), Some("1"));

    redis.resume();
    let again = json!({ "model": "scripted", "input": "again", "store": true });
    served_again(&served, "/v1/responses", &again).await;
    served.stop().await.unwrap();
}

/// Two replicas over one Redis share a rate limit exactly: requests
/// spread over both are admitted up to the limit and no further, each
/// answer says what is left (OpenAI's headers and the IETF draft's), the
/// refusal says when to retry, and another user's bucket is its own.
#[tokio::test]
async fn replicas_over_one_redis_share_a_rate_limit_and_say_what_is_left() {
    let redis = RedisServer::start();
    let replica = |url: String| {
        async move {
            let limit = json!({ "requests": 3, "window_s": 600, "by": "user" });
            let (path, filter) = spec("rate_limit", "limit", limit);
            let grants = Grants {
                kv: Some(StoreSpec::from(url.as_str()).into()),
                ..Grants::default()
            };
            // Each replica its own engine, as each is its own process.
            let engine = shallot::Engine::new(shallot::EngineConfig::default()).unwrap();
            let filters = vec![(path, FilterSpec { grants, ..filter })];
            let plugins = shallot_tests::load_in(&engine, filters).await;
            let kernel = Kernel::builder()
                .plugins(&plugins)
                .model(model())
                .build()
                .unwrap();
            Served::start(kernel, config()).await
        }
    };
    let (a, b) = (
        replica(redis.url()).await,
        replica(other_connection(&redis)).await,
    );
    let user = format!("spread-{}", std::process::id());
    let ask = |served: &Served, user: &str| {
        let request = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", served.base))
            .json(&json!({ "model": "scripted", "user": user,
                "messages": [{ "role": "user", "content": "hi" }] }));
        async move {
            let response = request.send().await.unwrap();
            let header = |name: &str| {
                let value = response.headers().get(name);
                value.map(|v| v.to_str().unwrap().to_owned())
            };
            let said = [
                "ratelimit-limit",
                "ratelimit-remaining",
                "x-ratelimit-remaining-requests",
                "retry-after",
            ]
            .map(header);
            let reset: u64 = header("ratelimit-reset").unwrap().parse().unwrap();
            assert!(reset > 0 && reset <= 600, "{reset}");
            (response.status().as_u16(), said)
        }
    };
    let some = |s: &str| Some(s.to_owned());
    for (served, left) in [(&a, "2"), (&b, "1"), (&a, "0")] {
        let (status, said) = ask(served, &user).await;
        assert_eq!(status, 200, "{said:?}");
        assert_eq!(said, [some("3"), some(left), some(left), None]);
    }
    for served in [&b, &a] {
        let (status, said) = ask(served, &user).await;
        assert_eq!(status, 429, "past the limit on either replica: {said:?}");
        assert_eq!(said[..3], [some("3"), some("0"), some("0")]);
        let retry: u64 = said[3].as_deref().unwrap().parse().unwrap();
        assert!(retry > 0 && retry <= 600, "{retry}");
    }
    let (status, said) = ask(&b, &format!("{user}-other")).await;
    assert_eq!(
        (status, said[1].as_deref()),
        (200, Some("2")),
        "a bucket of its own"
    );
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// A response kept by one replica continues on another: the route's store
/// is the Redis both use.
#[tokio::test]
async fn a_response_kept_by_one_replica_continues_on_another() {
    let redis = RedisServer::start();
    let replica = |url: String| {
        async move {
            let store = open_kv(StoreSpec::from(url.as_str())).await.unwrap();
            // Answers with how many messages it was sent.
            let model = ScriptedModel::new(|_, request: &ChatRequest| {
                Reply::Text(format!("saw {}", request.messages.len()))
            });
            let kernel = Kernel::builder().model(model).build().unwrap();
            let route = Route {
                store: Some(store),
                ..Route::proxy("scripted", kernel)
            };
            Served::gateway(Gateway::new(vec![route], config())).await
        }
    };
    let (a, b) = (
        replica(redis.url()).await,
        replica(other_connection(&redis)).await,
    );
    let text = |body: &Value| body["output"][0]["content"][0]["text"].clone();
    let first = json!({ "model": "scripted", "input": "hi" });
    let (status, _, body) = post(&a, "/v1/responses", &first).await;
    assert_eq!((status, text(&body)), (200, json!("saw 1")), "{body}");
    let next = json!({ "model": "scripted", "input": "and?", "previous_response_id": body["id"] });
    let (status, _, body) = post(&b, "/v1/responses", &next).await;
    assert_eq!(
        (status, text(&body)),
        (200, json!("saw 3")),
        "B continues what A kept: {body}"
    );
    let last = json!({ "model": "scripted", "input": "so?", "previous_response_id": body["id"] });
    let (_, _, body) = post(&a, "/v1/responses", &last).await;
    assert_eq!(text(&body), json!("saw 5"), "and A what B kept: {body}");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}
