//! A shared store's failure as a gateway's client sees it: `503`
//! `store_unavailable`, worth retrying (`Retry-After`), in each API's own
//! shape, never the `502` `upstream` that blames the model server; and,
//! the store back, served again.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::{Value, json};
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message, Usage};
use shallot::{
    CONVERSATION_HEADER, ChainError, ChatModel, Context, ErrorKind, FilterSet, FilterSpec, Gateway,
    Grants, Kernel, ModelEvent, Route, StoreSpec, open_kv,
};
use shallot_tests::{RedisServer, Reply, ScriptedModel, spec};
use tokio::sync::Semaphore;

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

/// The filter `plugin` (named as it names itself), configured with
/// `config`, its store the Redis at `url`.
fn stateful(plugin: &str, config: Value, url: &str) -> (PathBuf, FilterSpec) {
    let (path, filter) = spec(plugin, &plugin.replace('_', "-"), config);
    let grants = Grants {
        sleep_ms: if plugin == "cache" { 30_000 } else { 0 },
        kv: Some(StoreSpec::from(url).into()),
        ..Grants::default()
    };
    (path, FilterSpec { grants, ..filter })
}

/// A replica of the gateway with `filter` over `model`: its own engine,
/// as each replica is its own process.
async fn replica(filter: (PathBuf, FilterSpec), model: impl ChatModel + 'static) -> Served {
    watched(filter, model).await.0
}

/// Two replicas of the filter `plugin` configured with `config`, over
/// `redis` on connections of their own, the first over `a`, the second
/// over `b`.
async fn pair(
    plugin: &str,
    config: Value,
    redis: &RedisServer,
    a: impl ChatModel + 'static,
    b: impl ChatModel + 'static,
) -> (Served, Served) {
    let first = stateful(plugin, config.clone(), &redis.url());
    let second = stateful(plugin, config, &other_connection(redis));
    (replica(first, a).await, replica(second, b).await)
}

/// As [`replica`], with its filters, for a test to watch.
async fn watched(
    filter: (PathBuf, FilterSpec),
    model: impl ChatModel + 'static,
) -> (Served, FilterSet) {
    let engine = shallot::Engine::new(shallot::EngineConfig::default()).unwrap();
    let plugins = shallot_tests::load_in(&engine, vec![filter]).await;
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .build()
        .unwrap();
    (Served::start(kernel, config()).await, plugins)
}

/// Answers "fine", or fails as a model server does when asked to.
fn model() -> ScriptedModel {
    ScriptedModel::new(|_, request: &ChatRequest| {
        match request.messages.last().unwrap().text().as_str() {
            "break the provider" => Reply::Fail(ChainError::new(
                ErrorKind::Transient,
                "the model server broke",
            )),
            "ask it wrong" => Reply::Fail(ChainError::new(
                ErrorKind::InvalidRequest,
                "the model server cannot read this",
            )),
            _ => Reply::Text("fine".into()),
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
    let limit = json!({ "requests": 3, "window_s": 600, "by": "user" });
    let (a, b) = pair("rate_limit", limit, &redis, model(), model()).await;
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

/// Each stateful filter fails open or closed while its store fails, as
/// its `on_store_error` says (the cache open, limits and budgets closed,
/// by default).
#[tokio::test]
async fn each_filter_fails_open_or_closed_as_its_operator_says() {
    let prices = json!({ "scripted": { "input": 1.0, "output": 1.0 } });
    let cases = [
        ("cache", json!({}), 200),
        ("cache", json!({ "on_store_error": "closed" }), 503),
        ("rate_limit", json!({ "requests": 100 }), 503),
        (
            "rate_limit",
            json!({ "requests": 100, "on_store_error": "open" }),
            200,
        ),
        ("budget", json!({ "limit_usd": 5, "prices": prices }), 503),
        (
            "budget",
            json!({ "limit_usd": 5, "prices": prices, "on_store_error": "open" }),
            200,
        ),
    ];
    for (plugin, config, down) in cases {
        // A server of its own: the breaker's record is a server's.
        let mut redis = RedisServer::start();
        let what = format!("{plugin} {config}");
        let plugins = shallot_tests::load(vec![stateful(plugin, config, &redis.url())]).await;
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model())
            .build()
            .unwrap();
        let served = Served::start(kernel, self::config()).await;
        let (status, _, body) = post(&served, "/v1/chat/completions", &chat("hi")).await;
        assert_eq!(status, 200, "{what}: {body}");
        redis.stop();
        let (status, _, body) = post(&served, "/v1/chat/completions", &chat("hi")).await;
        assert_eq!(status, down, "{what}: {body}");
        if down == 200 {
            assert_eq!(body["choices"][0]["message"]["content"], "fine", "{what}");
        } else {
            assert_eq!(body["error"]["code"], "store_unavailable", "{what}: {body}");
        }
        served.stop().await.unwrap();
    }
}

/// Answers once the test opens its gate, saying when it has the request,
/// with the usage a real model reports (so what it cost is counted).
struct Billed {
    reached: Arc<Semaphore>,
    gate: Arc<Semaphore>,
}

#[async_trait::async_trait]
impl ChatModel for Billed {
    fn name(&self) -> &str {
        "scripted"
    }

    async fn chat(&self, _: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        self.reached.add_permits(1);
        self.gate.acquire().await.expect("the gate stays").forget();
        let mut response = ChatResponse::new(Message::assistant("made"), FinishReason::Complete);
        response.model = "scripted".to_owned();
        response.usage = Usage {
            input_tokens: 1000,
            output_tokens: 500,
            total_tokens: 1500,
        };
        Ok(response)
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let done = self.chat(request, context).await?;
        Ok(futures::stream::iter([Ok(ModelEvent::Done(done))]).boxed())
    }
}

/// An answer the model made is delivered when the store fails after it:
/// what it cost (the rate limit's tokens, the budget's price) is logged
/// as owed, never the answer thrown away.
#[tokio::test]
async fn an_answer_made_is_delivered_when_the_store_fails_after_it() {
    let prices = json!({ "scripted": { "input": 1.0, "output": 1.0 } });
    let cases = [
        ("rate_limit", json!({ "tokens": 100_000 })),
        ("budget", json!({ "limit_usd": 5, "prices": prices })),
    ];
    for (plugin, settings) in cases {
        let mut redis = RedisServer::start();
        let plugins = shallot_tests::load(vec![stateful(plugin, settings, &redis.url())]).await;
        let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let model = Billed {
            reached: reached.clone(),
            gate: gate.clone(),
        };
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(model)
            .build()
            .unwrap();
        let served = Served::start(kernel, config()).await;
        let asked = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", served.base))
            .json(&chat("hi"))
            .send();
        let asked = tokio::spawn(async move {
            let response = asked.await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        });
        reached.acquire().await.unwrap().forget();
        redis.stop();
        gate.add_permits(1);
        let (status, body) = asked.await.unwrap();
        assert_eq!(status, 200, "{plugin}: {body}");
        assert_eq!(body["choices"][0]["message"]["content"], "made", "{body}");
        served.stop().await.unwrap();
    }
}

/// Posts `body` as a chat completion to `served`: the status.
fn send(served: &Served, body: &Value) -> impl Future<Output = u16> + Send + 'static {
    let request = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .json(body);
    async move { request.send().await.unwrap().status().as_u16() }
}

/// A chat completion of `user`'s saying `text`.
fn from(user: &str, text: &str) -> Value {
    json!({ "model": "scripted", "user": user, "messages": [{ "role": "user", "content": text }] })
}

/// A call of `user`'s that holds exactly what [`Billed`] makes it cost:
/// 4000 bytes of text (1000 tokens in) and `max_tokens` 500.
fn costly(user: &str) -> Value {
    let mut call = from(user, &"x".repeat(4000));
    call["max_tokens"] = json!(500);
    call
}

/// A budget holds the most each call in flight may cost, on every replica
/// over one Redis: ten calls at once against a budget for seven serve
/// seven, the others refused before the model is called.
#[tokio::test]
async fn a_budget_holds_what_calls_in_flight_may_cost_across_replicas() {
    let redis = RedisServer::start();
    let budget = json!({ "limit_usd": 0.0105, "by": "user",
        "prices": { "scripted": { "input": 1.0, "output": 1.0 } } });
    let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let billed = || Billed {
        reached: reached.clone(),
        gate: gate.clone(),
    };
    let (a, b) = pair("budget", budget, &redis, billed(), billed()).await;
    let asked: Vec<_> = (0..10)
        .map(|i| tokio::spawn(send([&a, &b][i % 2], &costly("ida"))))
        .collect();
    // Seven are with the model; were the others let through, they would be
    // too, and answered when the gate opens.
    reached.acquire_many(7).await.unwrap().forget();
    gate.add_permits(10);
    let mut statuses = Vec::new();
    for asked in asked {
        statuses.push(asked.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [[200; 7].as_slice(), &[429; 3]].concat());
    assert_eq!(send(&b, &costly("ida")).await, 429, "seven spent it");
    assert_eq!(send(&a, &costly("jon")).await, 200, "a budget of its own");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// A rate limit gives back the place of a request that failed through no
/// fault of its client, on whichever replica it failed; one its client
/// got wrong still counts.
#[tokio::test]
async fn a_rate_limit_gives_back_the_place_of_a_request_that_failed() {
    let redis = RedisServer::start();
    let limit = json!({ "requests": 2, "window_s": 600, "by": "user" });
    let (a, b) = pair("rate_limit", limit, &redis, model(), model()).await;
    for served in [&a, &b, &a] {
        let status = send(served, &from("ned", "break the provider")).await;
        assert_eq!(status, 502, "the model server failed");
    }
    for served in [&b, &a] {
        assert_eq!(send(served, &from("ned", "hi")).await, 200, "refunded");
    }
    assert_eq!(send(&b, &from("ned", "hi")).await, 429, "two served");
    for served in [&a, &b] {
        let status = send(served, &from("ole", "ask it wrong")).await;
        assert_eq!(status, 400, "the client's request was wrong");
    }
    let status = send(&a, &from("ole", "hi")).await;
    assert_eq!(status, 429, "what the client got wrong counts");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// The tokens a call in flight holds count on every replica: while one
/// call holds a window's tokens on one replica, the other refuses.
#[tokio::test]
async fn tokens_held_by_a_call_in_flight_count_on_every_replica() {
    let redis = RedisServer::start();
    let limit = json!({ "tokens": 1500, "window_s": 600, "by": "user" });
    let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let billed = Billed {
        reached: reached.clone(),
        gate: gate.clone(),
    };
    let (a, b) = pair("rate_limit", limit, &redis, billed, model()).await;
    let first = tokio::spawn(send(&a, &costly("pia")));
    reached.acquire().await.unwrap().forget();
    let status = send(&b, &from("pia", "hi")).await;
    assert_eq!(status, 429, "the call in flight holds the window's tokens");
    gate.add_permits(1);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(send(&b, &from("pia", "hi")).await, 429, "and spent them");
    assert_eq!(
        send(&b, &from("quy", "hi")).await,
        200,
        "a window of its own"
    );
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// What a call gives back after its window ended is not taken from the
/// next window: a call that holds a window's 2,500 tokens, its counter
/// gone before it settles for 1,500 (as when the window ends or Redis
/// evicts it), leaves the next window whole, not starting 1,000 in debt:
/// two calls of 1,500 spend it.
#[tokio::test]
async fn tokens_given_back_after_their_window_ended_are_not_the_next_windows() {
    let redis = RedisServer::start();
    let limit = json!({ "tokens": 2500, "window_s": 600, "by": "user" });
    let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let billed = Billed {
        reached: reached.clone(),
        gate: gate.clone(),
    };
    let served = replica(stateful("rate_limit", limit, &redis.url()), billed).await;
    // 8000 bytes (2000 tokens) and 500 more for the answer: it holds 2500.
    let mut whole = from("rae", &"x".repeat(8000));
    whole["max_tokens"] = json!(500);
    let first = tokio::spawn(send(&served, &whole));
    reached.acquire().await.unwrap().forget();
    let store = open_kv(StoreSpec::from(redis.url().as_str()))
        .await
        .unwrap();
    let ended = store.delete("rate-limit", "tokens:user:rae").await.unwrap();
    assert!(ended, "the call's hold was in the window's counter");
    gate.add_permits(1);
    assert_eq!(first.await.unwrap(), 200, "settled for 1500, 1000 less");

    gate.add_permits(3);
    for _ in 0..2 {
        assert_eq!(send(&served, &costly("rae")).await, 200);
    }
    assert_eq!(
        send(&served, &from("rae", "hi")).await,
        429,
        "the next window's 2500 tokens are spent by its own two calls of 1500"
    );
    served.stop().await.unwrap();
}

/// Identical requests that miss the cache at once, on two replicas over
/// one Redis, make one model call: the others wait for its answer and are
/// answered from the cache.
#[tokio::test]
async fn identical_misses_on_every_replica_make_one_model_call() {
    let redis = RedisServer::start();
    let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let billed = || Billed {
        reached: reached.clone(),
        gate: gate.clone(),
    };
    let ((a, at_a), (b, at_b)) = (
        watched(stateful("cache", json!({}), &redis.url()), billed()).await,
        watched(
            stateful("cache", json!({}), &other_connection(&redis)),
            billed(),
        )
        .await,
    );
    let ask = |served: &Served| {
        let request = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", served.base))
            .json(&from("rae", "the same question"));
        async move {
            let response = request.send().await.unwrap();
            let said = response.headers().get("x-shallot-cache").cloned();
            let body: Value = response.json().await.unwrap();
            (said, body["choices"][0]["message"]["content"].clone())
        }
    };
    let first = tokio::spawn(ask(&a));
    reached.acquire().await.unwrap().forget();
    let others: Vec<_> = [&b, &a, &b].map(|served| tokio::spawn(ask(served))).into();
    // Every request is in its cache filter: the first with the model, the
    // others waiting (or, were they not, on their way to the model too).
    let in_use =
        || at_a.filters()[0].stats().instances_in_use + at_b.filters()[0].stats().instances_in_use;
    while in_use() < 4 {
        tokio::task::yield_now().await;
    }
    gate.add_permits(4);
    let (said, text) = first.await.unwrap();
    assert_eq!(
        (said.as_ref().map(|s| s.to_str().unwrap()), text),
        (Some("miss"), json!("made"))
    );
    for other in others {
        let (said, text) = other.await.unwrap();
        assert_eq!(
            (said.as_ref().map(|s| s.to_str().unwrap()), text),
            (Some("hit"), json!("made"))
        );
    }
    assert_eq!(
        reached.available_permits(),
        0,
        "one model call for four requests"
    );
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// Of many requests at once spread over three replicas over one Redis,
/// exactly the limit are admitted.
#[tokio::test]
async fn three_replicas_admit_exactly_the_limit_of_requests_at_once() {
    let redis = RedisServer::start();
    let limit = json!({ "requests": 10, "window_s": 600, "by": "user" });
    let mut replicas = Vec::new();
    // Three spellings of one server, so that each replica connects alone.
    let third = format!("{}/", other_connection(&redis));
    for url in [redis.url(), other_connection(&redis), third] {
        replicas.push(replica(stateful("rate_limit", limit.clone(), &url), model()).await);
    }
    let asked: Vec<_> = (0..30)
        .map(|i| tokio::spawn(send(&replicas[i % 3], &from("sal", "hi"))))
        .collect();
    let mut statuses = Vec::new();
    for asked in asked {
        statuses.push(asked.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [[200; 10].as_slice(), &[429; 20]].concat());
    for served in replicas {
        served.stop().await.unwrap();
    }
}

/// A Redis Cluster node or a Sentinel is refused when a filter's store is
/// opened, saying why, rather than failing every operation later with a
/// cross-slot error.
#[tokio::test]
async fn a_cluster_node_or_a_sentinel_is_refused_at_load_saying_why() {
    let nodes = std::env::temp_dir().join(format!("shallot-cluster-{}.conf", std::process::id()));
    let nodes = nodes.to_str().unwrap().to_owned();
    let cluster =
        RedisServer::start_with(&["--cluster-enabled", "yes", "--cluster-config-file", &nodes]);
    let refused = open_kv(cluster.url().as_str()).await.err().unwrap();
    assert!(
        refused.contains("grants.kv") && refused.contains("Redis Cluster node"),
        "{refused}"
    );
    let refused = shallot::open_store(cluster.url().as_str())
        .await
        .err()
        .unwrap();
    assert!(
        refused.contains("grants.memory") && refused.contains("not supported"),
        "{refused}"
    );
    let refused = open_kv("redis+sentinel://127.0.0.1:26379/mymaster")
        .await
        .err()
        .unwrap();
    assert!(refused.contains("Sentinel is not supported"), "{refused}");
    drop(cluster);
    let _ = std::fs::remove_file(nodes);
}

/// An identical request waits for the answer being made only as long as
/// its filter may sleep (a lease whose gateway died holds it no longer),
/// then asks the model itself.
#[tokio::test]
async fn identical_requests_wait_for_an_answer_only_as_long_as_they_may_sleep() {
    let redis = RedisServer::start();
    let (reached, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let billed = Billed {
        reached: reached.clone(),
        gate: gate.clone(),
    };
    let (path, mut filter) = stateful("cache", json!({}), &redis.url());
    filter.grants.sleep_ms = 300;
    let served = replica((path, filter), billed).await;
    let first = tokio::spawn(send(&served, &from("vic", "a slow answer")));
    reached.acquire().await.unwrap().forget();
    let second = tokio::spawn(send(&served, &from("vic", "a slow answer")));
    // The first still holds its lease: the second waited out its 300 ms of
    // sleep, not the lease's 60 s, and asked the model too.
    reached.acquire().await.unwrap().forget();
    gate.add_permits(2);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    served.stop().await.unwrap();
}
