//! What readying filters costs in `invoke` isolation: a streamed chat
//! through five filters with a fresh instance per invoke (prepared ahead,
//! and made on the request path), against the same five warm.

use std::time::{Duration, Instant};

use criterion::Criterion;
use serde_json::{Value, json};
use shallot::{Context, FilterSet, Kernel};
use shallot_bench::{conversation, criterion, median, model, report_failures, runtime, survive};
use shallot_tests::{engine, spec, target_dir, warm};
use tokio::runtime::Runtime;

/// The five filters of the `ready` benchmark, loaded into `engine`.
fn five(rt: &Runtime, engine: &shallot::Engine, isolated: bool) -> FilterSet {
    let specs = [
        ("logging", "logging", Value::Null),
        ("safeguard", "safeguard", json!({ "words": ["bomb"] })),
        ("passthrough", "passthrough", Value::Null),
        ("probe", "probe", json!({ "hooks": ["chat"] })),
        (
            "token_redact",
            "redact",
            json!({ "pattern": "sk-[a-z0-9]+" }),
        ),
    ];
    let specs = specs.into_iter().map(|(plugin, name, config)| {
        if isolated {
            spec(plugin, name, config)
        } else {
            warm(plugin, name, config)
        }
    });
    rt.block_on(shallot_tests::load_in(engine, specs.collect()))
}

/// Streamed chats through five filters: warm instances (the baseline);
/// fresh instances per invoke taken from the prepared ones, timing only the
/// request (the background refill runs between requests, untimed); and
/// fresh instances made on the request path, the whole CPU cost of
/// isolation.
fn bench_ready(c: &mut Criterion, rt: &Runtime) {
    let unprepared = shallot::Engine::new(shallot::EngineConfig {
        prepared_instances: 0,
        cache_dir: Some(target_dir().join("shallot-test-cache")),
        ..shallot::EngineConfig::default()
    })
    .unwrap();
    let shared = engine();
    let cases = [
        ("warm", &shared, false),
        ("invoke", &shared, true),
        ("invoke-unprepared", &unprepared, true),
    ];
    let request = conversation(1024);
    let mut group = c.benchmark_group("ready");
    for (id, engine, isolated) in cases {
        let kernel = Kernel::builder()
            .plugins(&five(rt, engine, isolated))
            .model(model())
            .build()
            .unwrap();
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut timed = Duration::ZERO;
                    for _ in 0..iters {
                        let start = Instant::now();
                        let streamed = kernel
                            .chat_stream(
                                request.clone(),
                                Context::new(),
                                |_: shallot::types::Token<'_>| {},
                            )
                            .await;
                        survive(id, streamed);
                        timed += start.elapsed();
                        if id == "invoke" {
                            // Untimed: the background refill runs here.
                            tokio::time::sleep(Duration::from_micros(500)).await;
                        }
                    }
                    timed
                })
            })
        });
    }
    group.finish();
}

fn main() {
    let rt = runtime();
    let mut c = criterion();
    bench_ready(&mut c, &rt);
    c.final_summary();
    report();
    report_failures();
}

fn report() {
    let (warm, fresh, inline) = (
        median("ready/warm"),
        median("ready/invoke"),
        median("ready/invoke-unprepared"),
    );
    println!(
        "\nready 5 filters in invoke isolation, on the request path: {:.1} µs ({:.1} µs per invoke vs {:.1} µs warm, {:.2}x)",
        (fresh - warm) / 1e3,
        fresh / 1e3,
        warm / 1e3,
        fresh / warm
    );
    println!(
        "the whole CPU cost of 5 fresh instances (made, configured, dropped): {:.1} µs ({:.1} µs per filter; an invoke costs {:.1}x a warm one)",
        (inline - warm) / 1e3,
        (inline - warm) / 5e3,
        inline / warm
    );
}
