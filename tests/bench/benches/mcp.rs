//! What the tool chain adds to an MCP server's tool: a call straight to the
//! server (`McpServer::call`), the same call as the kernel's tool with no
//! filter, and through one pass-through wasm layer around tools and a
//! `tool-guard` (the per-tenant allow list an MCP gateway wants), all to
//! the same server (`tests/mcp/server.py`, over stdio) in the same run.
//!
//! Needs the `mcp` package in the polyglot venv: `scripts/build-polyglot`.

use std::sync::Arc;

use criterion::Criterion;
use serde_json::{Value, json};
use shallot::{Context, Kernel, McpConfig, McpServer, TENANT};
use shallot_bench::{criterion, median, report_failures, survive};
use shallot_tests::{load, target_dir, warm};
use tokio::runtime::Runtime;

fn server(rt: &Runtime) -> Arc<McpServer> {
    let python = target_dir().join("polyglot/venv/bin/python");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mcp/server.py");
    let config = McpConfig {
        name: "bench".into(),
        prefix: None,
        command: Some(python.display().to_string()),
        url: None,
        headers: Default::default(),
        args: vec![script.display().to_string()],
        env: Default::default(),
        timeout_ms: 30_000,
        max_message_kib: 4096,
    };
    rt.block_on(McpServer::start(config))
        .expect("the test MCP server starts: run scripts/build-polyglot for its venv")
}

fn kernel(rt: &Runtime, server: &Arc<McpServer>, filters: Vec<(&str, &str, Value)>) -> Kernel {
    let specs = filters
        .into_iter()
        .map(|(plugin, name, config)| warm(plugin, name, config))
        .collect();
    let plugins = rt.block_on(load(specs));
    Kernel::builder()
        .plugins(&plugins)
        .mcp(server)
        .build()
        .unwrap()
}

fn time_calls(
    rt: &Runtime,
    bench: &str,
    iters: u64,
    call: impl AsyncFn() -> Result<(), shallot::ChainError>,
) -> std::time::Duration {
    rt.block_on(async {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            survive(bench, call().await);
        }
        start.elapsed()
    })
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let server = server(&rt);
    let arguments = json!({ "text": "hello" });
    let mut c: Criterion = criterion();
    let mut group = c.benchmark_group("mcp");
    group.bench_function("direct", |b| {
        b.iter_custom(|iters| {
            time_calls(&rt, "mcp/direct", iters, async || {
                server.call("echo", arguments.clone()).await.map(drop)
            })
        })
    });
    let guard = json!({ "allow": { "acme": ["bench_*"] } });
    for (name, filters) in [
        ("kernel", vec![]),
        ("passthrough", vec![("passthrough", "pass", Value::Null)]),
        ("tool-guard", vec![("tool_guard", "tool-guard", guard)]),
    ] {
        let kernel = kernel(&rt, &server, filters);
        let bench = format!("mcp/{name}");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                time_calls(&rt, &bench, iters, async || {
                    let context = Context::new().with(TENANT, "acme");
                    kernel
                        .tool("bench_echo", arguments.clone(), context)
                        .await
                        .map(drop)
                })
            })
        });
    }
    group.finish();
    c.final_summary();
    let direct = median("mcp/direct");
    println!("\n## Derived figures (this run)\n");
    println!("| call | µs | added µs | / direct |");
    println!("|---|---|---|---|");
    println!(
        "| straight to the server | {:.1} | - | 1.00x |",
        direct / 1e3
    );
    for name in ["kernel", "passthrough", "tool-guard"] {
        let took = median(&format!("mcp/{name}"));
        println!(
            "| {name} | {:.1} | {:.1} | {:.2}x |",
            took / 1e3,
            (took - direct) / 1e3,
            took / direct
        );
    }
    report_failures();
}
