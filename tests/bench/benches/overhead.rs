//! What a wasm filter costs, each figure a ratio against a baseline measured
//! in the same run:
//!
//! - `call`: one bare component call (an export that does nothing);
//! - `chat/<size>`: a chat invoke through 0, 1, 4 and 16 pass-through
//!   layers, wasm (warm instances) and native Rust closures, at 1 KiB and
//!   64 KiB of conversation;
//! - `ready`: a streamed chat through five filters with a fresh instance
//!   per invoke, against the same five warm;
//! - `tokens/<batch>`: streamed tokens through 0, 1 and 3 pass-through
//!   token transforms, wasm and native, one token per step and 64 per step;
//! - `lang/<language>`: one pass-through chat layer written in Rust, Python
//!   and JavaScript (the same probe filter, through each language's SDK),
//!   warm and with a fresh instance made per invoke.
//!
//! After criterion's own report the bench prints the derived table that
//! docs/PERFORMANCE.md records, and any calls that failed while measured
//! (a faulting filter is reported, not a reason to stop). Run with `just bench` (or
//! `cargo bench -p shallot-bench` after `cargo build-guests` and
//! `scripts/build-polyglot`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::{BenchmarkId, Criterion};
use futures::stream::{self, BoxStream, StreamExt};
use mimalloc::MiMalloc;
use serde_json::{Value, json};
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message, TokenBatch};
use shallot::{
    ChainError, ChatModel, Context, Filter, Kernel, ModelEvent, PluginSet, TokenTransform,
};
use shallot_tests::{engine, guest, load, spec, target_dir, warm};
use tokio::runtime::Runtime;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// Calls that failed while being measured, by bench: how many, and the
/// first error. A faulting filter is reported, not a reason to stop.
static FAILED: Mutex<BTreeMap<String, (u64, String)>> = Mutex::new(BTreeMap::new());

/// Records `result` of a call measured by `bench` if it failed.
fn survive<T, E: std::fmt::Display>(bench: &str, result: Result<T, E>) {
    if let Err(e) = result {
        let mut failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
        failed
            .entry(bench.to_owned())
            .or_insert((0, e.to_string()))
            .0 += 1;
    }
}

const LAYERS: [usize; 4] = [0, 1, 4, 16];
const SIZES: [(&str, usize); 2] = [("1KiB", 1024), ("64KiB", 64 * 1024)];
const TOKENS: usize = 4096;
const BATCHES: [usize; 2] = [1, 64];

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
}

/// A model that answers at once, so a benchmark measures the filters.
#[derive(Clone)]
struct Instant0 {
    response: ChatResponse,
}

#[async_trait]
impl ChatModel for Instant0 {
    fn name(&self) -> &str {
        "instant"
    }

    async fn chat(&self, _: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        Ok(self.response.clone())
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let token = ModelEvent::Token {
            text: "ok".into(),
            meta: None,
        };
        Ok(stream::iter([Ok(token), Ok(ModelEvent::Done(self.response.clone()))]).boxed())
    }
}

fn model() -> Instant0 {
    Instant0 {
        response: ChatResponse::new(Message::assistant("ok"), FinishReason::Complete),
    }
}

/// A conversation of about `bytes` bytes, in eight messages.
fn conversation(bytes: usize) -> ChatRequest {
    let chunk = "lorem ipsum ".repeat(bytes / 8 / 12 + 1);
    ChatRequest::new(
        (0..8)
            .map(|i| {
                if i % 2 == 0 {
                    Message::user(&chunk[..bytes / 8])
                } else {
                    Message::assistant(&chunk[..bytes / 8])
                }
            })
            .collect(),
    )
}

/// A native filter that passes everything through: the baseline layer.
struct Native(String);

impl Filter for Native {
    fn name(&self) -> &str {
        &self.0
    }

    fn hooks(&self) -> &[shallot::Hook] {
        &[shallot::Hook::AroundChat, shallot::Hook::TokenTransform]
    }

    fn token_transform(&self) -> Option<Box<dyn TokenTransform>> {
        Some(Box::new(Identity))
    }
}

struct Identity;

impl TokenTransform for Identity {
    fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError> {
        Ok(tokens)
    }
}

fn native_kernel(layers: usize) -> Kernel {
    (0..layers)
        .fold(Kernel::builder(), |k, i| {
            k.filter(Native(format!("native-{i}")))
        })
        .model(model())
        .build()
        .unwrap()
}

fn passthrough_kernel(rt: &Runtime, layers: usize) -> Kernel {
    let specs = (0..layers)
        .map(|i| warm("passthrough", &format!("wasm-{i}"), Value::Null))
        .collect();
    let plugins = rt.block_on(load(specs));
    Kernel::builder()
        .plugins(&plugins)
        .model(model())
        .build()
        .unwrap()
}

fn bench_bare_call(c: &mut Criterion, rt: &Runtime) {
    use wasmtime::component::{Component, Linker};
    let engine = engine();
    let component =
        Component::from_file(engine.wasmtime(), guest("bare")).expect("the bare guest compiles");
    let linker: Linker<()> = Linker::new(engine.wasmtime());
    let mut store = wasmtime::Store::new(engine.wasmtime(), ());
    store.set_epoch_deadline(u64::MAX / 2);
    let instance = rt
        .block_on(linker.instantiate_async(&mut store, &component))
        .expect("instantiates");
    let noop = instance
        .get_typed_func::<(), ()>(&mut store, "noop")
        .expect("exports noop");
    c.bench_function("call/bare-sync", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                noop.call(&mut store, ()).unwrap();
            }
            start.elapsed()
        })
    });
    c.bench_function("call/bare", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    noop.call_async(&mut store, ()).await.unwrap();
                }
                start.elapsed()
            })
        })
    });
}

fn time_chats(
    rt: &Runtime,
    bench: &str,
    kernel: &Kernel,
    request: &ChatRequest,
    iters: u64,
) -> Duration {
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            survive(bench, kernel.chat(request.clone(), Context::new()).await);
        }
        start.elapsed()
    })
}

fn bench_chat(c: &mut Criterion, rt: &Runtime) {
    for (label, bytes) in SIZES {
        let request = conversation(bytes);
        let mut group = c.benchmark_group(format!("chat/{label}"));
        for layers in LAYERS {
            let kernel = passthrough_kernel(rt, layers);
            let bench = format!("chat/{label}/wasm/{layers}");
            group.bench_with_input(BenchmarkId::new("wasm", layers), &layers, |b, _| {
                b.iter_custom(|iters| time_chats(rt, &bench, &kernel, &request, iters))
            });
            if layers > 0 {
                let kernel = native_kernel(layers);
                let bench = format!("chat/{label}/native/{layers}");
                group.bench_with_input(BenchmarkId::new("native", layers), &layers, |b, _| {
                    b.iter_custom(|iters| time_chats(rt, &bench, &kernel, &request, iters))
                });
            }
        }
        group.finish();
    }
}

/// The five filters of the `ready` benchmark, loaded into `engine`.
fn five(rt: &Runtime, engine: &shallot::Engine, isolated: bool) -> PluginSet {
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

const LANGUAGES: [(&str, &str); 3] = [
    ("rust", "probe"),
    ("python", "py_probe"),
    ("javascript", "js_probe"),
];

/// One pass-through chat layer per language: warm, and with a fresh
/// instance made on the request path (no prepared instances), so the
/// difference is the whole cost of instantiating, configuring and dropping
/// one.
fn bench_languages(c: &mut Criterion, rt: &Runtime) {
    let unprepared = shallot::Engine::new(shallot::EngineConfig {
        prepared_instances: 0,
        cache_dir: Some(target_dir().join("shallot-test-cache")),
        ..shallot::EngineConfig::default()
    })
    .unwrap();
    let request = conversation(1024);
    let mut group = c.benchmark_group("lang");
    group.bench_function("none", |b| {
        let kernel = Kernel::builder().model(model()).build().unwrap();
        b.iter_custom(|iters| time_chats(rt, "lang/none", &kernel, &request, iters))
    });
    for (language, plugin) in LANGUAGES {
        let config = json!({ "hooks": ["chat"] });
        let cases = [
            ("warm", warm(plugin, language, config.clone()), engine()),
            ("fresh", spec(plugin, language, config), unprepared.clone()),
        ];
        for (mode, filter, engine) in cases {
            let plugins = rt.block_on(shallot_tests::load_in(&engine, vec![filter]));
            let kernel = Kernel::builder()
                .plugins(&plugins)
                .model(model())
                .build()
                .unwrap();
            let bench = format!("lang/{language}/{mode}");
            group.bench_function(BenchmarkId::new(language, mode), |b| {
                b.iter_custom(|iters| time_chats(rt, &bench, &kernel, &request, iters))
            });
        }
    }
    group.finish();
}

fn bench_tokens(c: &mut Criterion, rt: &Runtime) {
    let text: Vec<String> = (0..TOKENS).map(|i| format!("t{} ", i % 100)).collect();
    for batch in BATCHES {
        let batches: Vec<TokenBatch> = text
            .chunks(batch)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|t| shallot::types::Token {
                        text: t,
                        meta: None,
                    })
                    .collect()
            })
            .collect();
        let mut group = c.benchmark_group(format!("tokens/{batch}"));
        group.throughput(criterion::Throughput::Elements(TOKENS as u64));
        for layers in [0, 1, 3] {
            let mut kernels = vec![("wasm", passthrough_kernel(rt, layers))];
            if layers > 0 {
                kernels.push(("native", native_kernel(layers)));
            }
            for (kind, kernel) in kernels {
                let bench = format!("tokens/{batch}/{kind}/{layers}");
                let bench = bench.as_str();
                group.bench_with_input(BenchmarkId::new(kind, layers), &layers, |b, _| {
                    b.iter_custom(|iters| {
                        rt.block_on(async {
                            let start = Instant::now();
                            for _ in 0..iters {
                                let opened = kernel
                                    .token_stream(Context::new(), |_: shallot::types::Token<'_>| {})
                                    .await;
                                let mut stream = match opened {
                                    Ok(stream) => stream,
                                    Err(e) => {
                                        survive(bench, Err::<(), _>(e));
                                        continue;
                                    }
                                };
                                for tokens in &batches {
                                    survive(bench, stream.push(tokens.clone()).await);
                                }
                                survive(bench, stream.finish().await);
                            }
                            start.elapsed()
                        })
                    })
                });
            }
        }
        group.finish();
    }
}

/// Criterion's median estimate for `id`, in nanoseconds (the median: this
/// machine is a noisy VM); NaN for a bench this run did not measure (a
/// filter on the command line).
fn median(id: &str) -> f64 {
    let path: PathBuf = target_dir()
        .join("criterion")
        .join(id)
        .join("new")
        .join("estimates.json");
    std::fs::read(&path)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|json| json["median"]["point_estimate"].as_f64())
        .unwrap_or(f64::NAN)
}

fn report() {
    let bare = median("call_bare");
    println!("\n## Derived figures (this run)\n");
    println!(
        "bare component call: {:.2} µs; two bare calls: {:.2} µs\n",
        bare / 1e3,
        2.0 * bare / 1e3
    );
    println!(
        "| body | layers | wasm µs/layer | native µs/layer | wasm / 2 bare calls | wasm / native |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, _) in SIZES {
        let base = median(&format!("chat_{label}/wasm/0"));
        for layers in &LAYERS[1..] {
            let wasm = (median(&format!("chat_{label}/wasm/{layers}")) - base) / *layers as f64;
            let native = (median(&format!("chat_{label}/native/{layers}")) - base) / *layers as f64;
            println!(
                "| {label} | {layers} | {:.2} | {:.3} | {:.2}x | {:.0}x |",
                wasm / 1e3,
                native / 1e3,
                wasm / (2.0 * bare),
                wasm / native
            );
        }
    }
    let none = median("lang/none");
    let layer = |language: &str| median(&format!("lang/{language}/warm")) - none;
    let fresh = |language: &str| {
        median(&format!("lang/{language}/fresh")) - median(&format!("lang/{language}/warm"))
    };
    println!("\n| language | layer µs (warm) | layer / Rust | fresh instance µs | fresh / Rust |");
    println!("|---|---|---|---|---|");
    for (language, _) in LANGUAGES {
        println!(
            "| {language} | {:.2} | {:.1}x | {:.1} | {:.1}x |",
            layer(language) / 1e3,
            layer(language) / layer("rust"),
            fresh(language) / 1e3,
            fresh(language) / fresh("rust")
        );
    }
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
    println!(
        "\n| batch | filters | wasm ns/token/filter | native ns/token/filter | wasm Mtokens/s | wasm / native |"
    );
    println!("|---|---|---|---|---|---|");
    for batch in BATCHES {
        let base = median(&format!("tokens_{batch}/wasm/0"));
        for layers in [1usize, 3] {
            let total = median(&format!("tokens_{batch}/wasm/{layers}"));
            let wasm = (total - base) / (TOKENS * layers) as f64;
            let native = (median(&format!("tokens_{batch}/native/{layers}")) - base)
                / (TOKENS * layers) as f64;
            let rate = TOKENS as f64 / total * 1e3;
            println!(
                "| {batch} | {layers} | {wasm:.0} | {native:.1} | {rate:.1} | {:.0}x |",
                wasm / native.max(0.1)
            );
        }
    }
    let failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
    if !failed.is_empty() {
        println!("\n## Calls that failed while measured (their times are not a layer's cost)\n");
        println!("| bench | failed calls | first error |");
        println!("|---|---|---|");
        for (bench, (count, error)) in failed.iter() {
            println!("| {bench} | {count} | {error} |");
        }
    }
}

fn main() {
    let rt = runtime();
    assert!(Path::new(&guest("passthrough")).is_file());
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bench_bare_call(&mut c, &rt);
    bench_chat(&mut c, &rt);
    bench_ready(&mut c, &rt);
    bench_tokens(&mut c, &rt);
    bench_languages(&mut c, &rt);
    c.final_summary();
    report();
}
