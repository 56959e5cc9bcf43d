//! Who a filter is, the operator or the host decides, never the filter: a
//! third party's plugin that calls itself what another filter is called
//! (here the built-in `rate-limit`) is named after its file unless the
//! operator names it, so the `kv` keys, metrics and trace lines it gets
//! are its own, in every store that filter sets (routes, replicas) share.

use serde_json::{Value, json};
use shallot::{Context, ErrorKind, FilterSet, Grants};
use shallot_tests::{RedisServer, answering, ask, every_store, lines, load, spec, trace_file};

/// Filters of `plugin` with `config` and `grants` that the operator did
/// not name.
async fn unnamed(plugin: &str, config: Value, grants: Grants) -> FilterSet {
    let (path, mut filter) = spec(plugin, plugin, config);
    filter.name = None;
    filter.grants = grants;
    load(vec![(path, filter)]).await
}

fn keys_in(store: &str) -> Grants {
    Grants {
        kv: Some(shallot::StoreSpec::from(store).into()),
        ..Grants::default()
    }
}

#[tokio::test]
async fn a_plugin_that_calls_itself_rate_limit_cannot_touch_the_limiters_counters() {
    let redis = RedisServer::start();
    for store in every_store("identity-impostor", &redis) {
        // Two filter sets over one store, as two routes or two replicas:
        // the limiter in one, the impostor in the other.
        let config = json!({ "requests": 1, "window_s": 3600, "by": "user" });
        let limiter = unnamed("rate_limit", config, keys_in(&store)).await;
        let reset = json!({ "key": "requests:user:dana", "delta": -1000 });
        let impostor = unnamed("impostor", reset, keys_in(&store)).await;
        let (limited, other) = (answering(&limiter, "ok"), answering(&impostor, "ok"));
        let dana = || Context::new().with(shallot::USER, "dana");
        limited.chat(ask("first"), dana()).await.unwrap();
        other.chat(ask("reset"), dana()).await.unwrap();
        let second = limited.chat(ask("second"), dana()).await;
        assert!(
            second
                .as_ref()
                .is_err_and(|e| e.kind == ErrorKind::LimitExceeded),
            "{store}: the impostor reset the limiter's counter: {second:?}"
        );
        assert_eq!(limiter.filters()[0].name(), "rate-limit");
        let filter = &impostor.filters()[0];
        assert_eq!(
            (filter.name(), filter.declared_name()),
            ("impostor", "rate-limit")
        );
    }
}

#[tokio::test]
async fn a_plugins_trace_lines_and_metrics_carry_its_given_name_not_its_own() {
    let path = trace_file("identity-impostor");
    let grants = Grants {
        trace: Some(path.clone().into()),
        ..keys_in(":memory:identity-trace")
    };
    let config = json!({ "key": "k", "delta": 1 });
    let impostor = unnamed("impostor", config, grants).await;
    answering(&impostor, "ok")
        .chat(ask("hi"), Context::new())
        .await
        .unwrap();
    let written = lines(&path);
    assert_eq!(written.len(), 1, "{written:?}");
    assert_eq!(
        (&written[0]["filter"], &written[0]["by"]),
        (&json!("impostor"), &json!("rate-limit")),
        "the host names the writer; what the filter says is its own field"
    );
    let stats = impostor.filters()[0].stats();
    assert_eq!(stats.name, "impostor");
    assert_eq!(stats.metrics.len(), 1, "{:?}", stats.metrics);
}
