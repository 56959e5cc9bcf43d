//! What the tool chain adds to an MCP server's tool: a call straight to the
//! server (`McpServer::call`), the same call as the kernel's tool with no
//! filter, and through one pass-through wasm layer around tools and a
//! `tool-guard` (the per-tenant allow list an MCP gateway wants), all to
//! the same server (`tests/mcp/server.py`, over stdio) in the same run.
//!
//! And what the gateway's `/mcp` adds: an MCP client's `tools/call`
//! straight to the server over streamable HTTP, against the same call
//! through `shallot serve`'s `/mcp` (one more HTTP hop, the tool chain, the
//! token transforms) to that server, with no filter, a pass-through layer,
//! and `tool-guard`.
//!
//! Needs the `mcp` package in the polyglot venv: `scripts/build-polyglot`.

use std::sync::Arc;

use criterion::Criterion;
use serde_json::{Value, json};
use shallot::{
    Context, Gateway, GatewayConfig, Kernel, KernelBuilder, McpConfig, McpEndpoint, McpServer,
    TENANT,
};
use shallot_bench::{criterion, median, report_failures, survive};
use shallot_tests::{McpHttpServer, load, mcp_test_server, warm};
use tokio::runtime::Runtime;

/// The test server as the `[[mcp]]` table `bench` over stdio, or at `url`.
fn started(rt: &Runtime, url: Option<&str>) -> Arc<McpServer> {
    let config = McpConfig {
        name: "bench".into(),
        timeout_ms: 30_000,
        max_message_kib: 4096,
        ..mcp_test_server(30_000)
    };
    let config = match url {
        None => config,
        Some(url) => McpConfig {
            command: None,
            args: Vec::new(),
            url: Some(url.to_owned()),
            ..config
        },
    };
    rt.block_on(McpServer::start(config))
        .expect("the test MCP server starts: run scripts/build-polyglot for its venv")
}

fn builder(
    rt: &Runtime,
    server: &Arc<McpServer>,
    filters: Vec<(&str, &str, Value)>,
) -> KernelBuilder {
    let specs = filters
        .into_iter()
        .map(|(plugin, name, config)| warm(plugin, name, config))
        .collect();
    let plugins = rt.block_on(load(specs));
    Kernel::builder().plugins(&plugins).mcp(server)
}

/// A gateway serving `/mcp` over `server` with `filters`, on a free
/// loopback port; its `/mcp` URL.
fn gateway(rt: &Runtime, server: &Arc<McpServer>, filters: Vec<(&str, &str, Value)>) -> String {
    let endpoint = McpEndpoint::new(builder(rt, server, filters)).unwrap();
    let gateway = Gateway::new(Vec::new(), GatewayConfig::default());
    gateway.set_mcp(Some(endpoint));
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    rt.spawn(async move { gateway.serve(listener, std::future::pending()).await });
    url
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

/// The derived figures of `group`: each of `names` against its `direct`.
fn report(group: &str, title: &str, names: &[&str]) {
    let direct = median(&format!("{group}/direct"));
    println!("\n## {title} (this run)\n");
    println!("| call | µs | added µs | / direct |");
    println!("|---|---|---|---|");
    println!(
        "| straight to the server | {:.1} | - | 1.00x |",
        direct / 1e3
    );
    for name in names {
        let took = median(&format!("{group}/{name}"));
        println!(
            "| {name} | {:.1} | {:.1} | {:.2}x |",
            took / 1e3,
            (took - direct) / 1e3,
            took / direct
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let server = started(&rt, None);
    let arguments = json!({ "text": "hello" });
    let guard = json!({ "allow": { "acme": ["bench_*"], "*": ["bench_*"] } });
    let layers = || {
        [
            ("kernel", vec![]),
            ("passthrough", vec![("passthrough", "pass", Value::Null)]),
            (
                "tool-guard",
                vec![("tool_guard", "tool-guard", guard.clone())],
            ),
        ]
    };
    let mut c: Criterion = criterion();
    let mut group = c.benchmark_group("mcp");
    group.bench_function("direct", |b| {
        b.iter_custom(|iters| {
            time_calls(&rt, "mcp/direct", iters, async || {
                server.call("echo", arguments.clone()).await.map(drop)
            })
        })
    });
    for (name, filters) in layers() {
        let kernel = builder(&rt, &server, filters).build().unwrap();
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

    // An MCP client (shallot's own, over streamable HTTP) to the server,
    // and to `/mcp` in front of it.
    let http = rt.block_on(McpHttpServer::start());
    let upstream = started(&rt, Some(&http.url));
    let mut group = c.benchmark_group("mcp-gateway");
    group.bench_function("direct", |b| {
        b.iter_custom(|iters| {
            time_calls(&rt, "mcp-gateway/direct", iters, async || {
                upstream.call("echo", arguments.clone()).await.map(drop)
            })
        })
    });
    for (name, filters) in layers() {
        let client = started(&rt, Some(&gateway(&rt, &upstream, filters)));
        let bench = format!("mcp-gateway/{name}");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                time_calls(&rt, &bench, iters, async || {
                    client.call("bench_echo", arguments.clone()).await.map(drop)
                })
            })
        });
    }
    group.finish();
    c.final_summary();
    report(
        "mcp",
        "An MCP server's tool through the kernel",
        &["kernel", "passthrough", "tool-guard"],
    );
    report(
        "mcp-gateway",
        "A tools/call through the gateway's /mcp",
        &["kernel", "passthrough", "tool-guard"],
    );
    report_failures();
}
