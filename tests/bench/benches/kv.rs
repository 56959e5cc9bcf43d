//! What the `kv` grant costs: a `get` and an `add` in each store
//! (in-process, an SQLite file, Redis over loopback), as the host's store
//! runs them, and a chat through `rate-limit` over each store, against a
//! chat through one pass-through wasm layer and a chat with no filter, all
//! in the same run.

use criterion::Criterion;
use serde_json::json;
use shallot::types::ChatRequest;
use shallot::{Context, FilterSpec, Grants, Kernel, KvStore, StoreSpec, USER};
use shallot_bench::{
    conversation, criterion, median, model, report_failures, survive, time_chats, wasm_kernel,
};
use shallot_tests::{RedisServer, load, target_dir, warm};
use tokio::runtime::Runtime;

/// The stores, by the names the benches use.
fn stores(redis: &RedisServer) -> Vec<(&'static str, String)> {
    let file = target_dir().join("bench-kv.db");
    let _ = std::fs::remove_file(&file);
    vec![
        ("in-process", ":memory:bench".to_owned()),
        ("sqlite", file.display().to_string()),
        ("redis", redis.url()),
    ]
}

fn rate_limited(rt: &Runtime, store: &str) -> Kernel {
    let (path, spec) = warm(
        "rate_limit",
        "rate-limit",
        json!({ "requests": 1_000_000_000u64, "window_s": 3600, "by": "user" }),
    );
    let spec = FilterSpec {
        grants: Grants {
            kv: Some(StoreSpec::from(store).into()),
            ..Grants::default()
        },
        ..spec
    };
    let plugins = rt.block_on(load(vec![(path, spec)]));
    Kernel::builder()
        .plugins(&plugins)
        .model(model())
        .build()
        .unwrap()
}

fn time_limited(
    rt: &Runtime,
    bench: &str,
    kernel: &Kernel,
    request: &ChatRequest,
    iters: u64,
) -> std::time::Duration {
    rt.block_on(async {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            let context = Context::new().with(USER, "bench");
            survive(bench, kernel.chat(request.clone(), context).await);
        }
        start.elapsed()
    })
}

/// Runs `iters` store operations one after another.
fn time_ops<F: std::future::Future<Output = Result<(), shallot::ChainError>>>(
    rt: &Runtime,
    iters: u64,
    op: impl Fn() -> F,
) -> std::time::Duration {
    rt.block_on(async {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            survive("kv/op", op().await);
        }
        start.elapsed()
    })
}

fn main() {
    // Redis is reached over a socket: this runtime has I/O too.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let redis = RedisServer::start();
    let mut c: Criterion = criterion();
    let request = conversation(1024);
    let mut group = c.benchmark_group("kv");
    let bare = Kernel::builder().model(model()).build().unwrap();
    group.bench_function("chat/none", |b| {
        b.iter_custom(|iters| time_chats(&rt, "kv/chat/none", &bare, &request, iters))
    });
    let pass = wasm_kernel(&rt, "passthrough", 1);
    group.bench_function("chat/passthrough", |b| {
        b.iter_custom(|iters| time_chats(&rt, "kv/chat/passthrough", &pass, &request, iters))
    });
    let names = stores(&redis);
    for (name, spec) in &names {
        let store: std::sync::Arc<dyn KvStore> =
            rt.block_on(shallot::open_kv(spec.as_str())).unwrap();
        rt.block_on(store.set("bench", None, "key", "value", None))
            .unwrap();
        group.bench_function(format!("get/{name}"), |b| {
            b.iter_custom(|iters| {
                time_ops(&rt, iters, || async {
                    store.get("bench", "key").await.map(drop)
                })
            })
        });
        group.bench_function(format!("add/{name}"), |b| {
            b.iter_custom(|iters| {
                time_ops(&rt, iters, || async {
                    store.add("bench", None, "counter", 1, None).await.map(drop)
                })
            })
        });
        let limited = rate_limited(&rt, spec);
        let bench = format!("kv/chat/rate-limit/{name}");
        group.bench_function(format!("chat/rate-limit/{name}"), |b| {
            b.iter_custom(|iters| time_limited(&rt, &bench, &limited, &request, iters))
        });
    }
    group.finish();
    c.final_summary();
    report(&names);
    report_failures();
}

fn report(stores: &[(&str, String)]) {
    let none = median("kv/chat_none");
    let layer = median("kv/chat_passthrough") - none;
    println!("\n## Derived figures (this run)\n");
    println!("pass-through wasm layer: {:.1} µs a chat\n", layer / 1e3);
    println!("| store | get µs | / layer | add µs | / layer | rate-limit µs a chat | / layer |");
    println!("|---|---|---|---|---|---|---|");
    for (name, _) in stores {
        let get = median(&format!("kv/get_{name}"));
        let add = median(&format!("kv/add_{name}"));
        let limited = median(&format!("kv/chat_rate-limit_{name}")) - none;
        println!(
            "| {name} | {:.1} | {:.2}x | {:.1} | {:.2}x | {:.1} | {:.2}x |",
            get / 1e3,
            get / layer,
            add / 1e3,
            add / layer,
            limited / 1e3,
            limited / layer
        );
    }
}
