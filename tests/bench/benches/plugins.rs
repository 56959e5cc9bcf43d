//! What each built-in plugin costs per call, against the pass-through
//! guest on the same call in the same run (for a stream, `copy_tokens`: a
//! live transform copying its tokens, the SDK's own `PassThrough` being
//! left out of the descriptor): a chat (1 KiB conversation), a
//! tool call, a turn, or a streamed answer of 64 words, through one warm
//! instance of the plugin configured as docs/filters/ shows, and the same
//! call with no filter. Prints each plugin's `.wasm` size beside its cost.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use criterion::Criterion;
use serde_json::{Value, json};
use shallot::types::{ChatRequest, Message, ToolSpec, TurnRequest};
use shallot::{Context, FilterSpec, Grants, Kernel};
use shallot_bench::{
    conversation, criterion, median, model_saying, report_failures, runtime, survive,
};
use shallot_tests::{Collector, guest, load, warm};
use tokio::runtime::Runtime;

/// The call a plugin acts on.
#[derive(Clone, Copy, PartialEq)]
enum Call {
    Chat,
    Tool,
    Turn,
    Stream,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Chat => "chat",
            Call::Tool => "tool",
            Call::Turn => "turn",
            Call::Stream => "stream",
        }
    }

    /// The guest that passes this call through: the floor of its cost.
    fn floor(self) -> &'static str {
        match self {
            Call::Stream => "copy_tokens",
            _ => "passthrough",
        }
    }
}

/// A plugin (its `.wasm` stem and name), its call, config and grants.
struct Case {
    plugin: &'static str,
    call: Call,
    config: Value,
    grants: Grants,
}

fn case(plugin: &'static str, call: Call, config: Value) -> Case {
    Case {
        plugin,
        call,
        config,
        grants: Grants::default(),
    }
}

fn cases() -> Vec<Case> {
    let schema = json!({ "type": "object", "properties": { "answer": { "type": "integer" } }, "required": ["answer"] });
    vec![
        case("passthrough", Call::Chat, Value::Null),
        case("logging", Call::Chat, Value::Null),
        case(
            "safeguard",
            Call::Chat,
            json!({ "words": ["bomb", "nerve agent", "exploit"] }),
        ),
        case("call_limit", Call::Chat, Value::Null),
        case(
            "model_fallback",
            Call::Chat,
            json!({ "models": ["backup"] }),
        ),
        case("model_retry", Call::Chat, Value::Null),
        case("tool_search", Call::Chat, Value::Null),
        Case {
            grants: Grants {
                trace: Some("/dev/null".into()),
                clock: true,
                ..Grants::default()
            },
            ..case(
                "trace",
                Call::Chat,
                json!({ "turns": false, "tools": false }),
            )
        },
        Case {
            grants: Grants {
                memory: Some(":memory:".into()),
                ..Grants::default()
            },
            ..case("memory", Call::Chat, json!({ "window": 40 }))
        },
        case("passthrough", Call::Tool, Value::Null),
        case("timeout", Call::Tool, json!({ "timeout_ms": 1000 })),
        case("tool_retry", Call::Tool, Value::Null),
        case("approval", Call::Tool, json!({ "default": "deny" })),
        case("passthrough", Call::Turn, Value::Null),
        case(
            "validation",
            Call::Turn,
            json!({ "required": ["answer"], "max_length": 1000 }),
        ),
        case("schema_validation", Call::Turn, json!({ "schema": schema })),
        case("copy_tokens", Call::Stream, Value::Null),
        case(
            "token_redact",
            Call::Stream,
            json!({ "pattern": "sk-[A-Za-z0-9]+", "window": 48 }),
        ),
        case("hold_release", Call::Stream, json!({ "words": ["secret"] })),
        case("final_answer", Call::Stream, Value::Null),
    ]
}

const ANSWER: &str = r#"{"answer": 42}"#;

fn kernel(rt: &Runtime, case: Option<&Case>) -> Kernel {
    let specs: Vec<(PathBuf, FilterSpec)> = case
        .map(|c| {
            let (path, spec) = warm(c.plugin, c.plugin, c.config.clone());
            (
                path,
                FilterSpec {
                    grants: c.grants.clone(),
                    ..spec
                },
            )
        })
        .into_iter()
        .collect();
    let plugins = rt.block_on(load(specs));
    let answer = match case.map(|c| c.call) {
        Some(Call::Stream) => "word ".repeat(63) + "end",
        _ => ANSWER.to_owned(),
    };
    let tools = [
        "get_weather",
        "send_email",
        "create_invoice",
        "list_files",
        "run_sql",
        "read_file",
        "restart_server",
        "convert_currency",
    ];
    let mut builder = Kernel::builder()
        .plugins(&plugins)
        .model(model_saying(&answer));
    for name in tools {
        builder = builder.tool(
            ToolSpec::new(
                name,
                format!("{name} for the user"),
                json!({ "type": "object" }),
            ),
            |args: Value, _| async move { Ok(args) },
        );
    }
    builder.build().unwrap()
}

/// Runs `iters` calls of `call` through `kernel`.
fn time(rt: &Runtime, bench: &str, kernel: &Kernel, call: Call, iters: u64) -> std::time::Duration {
    static CONVERSATION: AtomicU64 = AtomicU64::new(0);
    let chat = {
        let request = conversation(1024);
        ChatRequest {
            tools: kernel.tools().into(),
            ..request
        }
    };
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let id = CONVERSATION.fetch_add(1, Ordering::Relaxed).to_string();
            let context = Context::new().with("conversation_id", id.as_str());
            match call {
                Call::Chat => survive(bench, kernel.chat(chat.clone(), context).await),
                Call::Tool => survive(
                    bench,
                    kernel
                        .tool("get_weather", json!({ "city": "Oslo" }), context)
                        .await,
                ),
                Call::Turn => {
                    let turn = TurnRequest::new(vec![Message::user("the answer, as JSON")]);
                    let result = kernel.turn(turn, context).await;
                    survive(
                        bench,
                        match result {
                            shallot::types::TurnResult::Done(_) => Ok(()),
                            other => Err(format!("{other:?}")),
                        },
                    );
                }
                Call::Stream => {
                    let sink = Collector::default();
                    survive(bench, kernel.chat_stream(chat.clone(), context, sink).await);
                }
            }
        }
        start.elapsed()
    })
}

fn main() {
    let rt = runtime();
    let mut c: Criterion = criterion();
    let cases = cases();
    for call in [Call::Chat, Call::Tool, Call::Turn, Call::Stream] {
        let mut group = c.benchmark_group(format!("plugins/{}", call.name()));
        let bare = kernel(&rt, None);
        let bench = format!("plugins/{}/none", call.name());
        group.bench_function("none", |b| {
            b.iter_custom(|iters| time(&rt, &bench, &bare, call, iters))
        });
        for case in cases.iter().filter(|c| c.call == call) {
            let kernel = kernel(&rt, Some(case));
            let bench = format!("plugins/{}/{}", call.name(), case.plugin);
            group.bench_function(case.plugin, |b| {
                b.iter_custom(|iters| time(&rt, &bench, &kernel, call, iters))
            });
        }
        group.finish();
    }
    c.final_summary();
    report(&cases);
    report_failures();
}

fn report(cases: &[Case]) {
    println!("\n## Derived figures (this run)\n");
    println!("| plugin | call | .wasm size | µs per call over no filter | / pass-through |");
    println!("|---|---|---|---|---|");
    for case in cases {
        let call = case.call.name();
        let none = median(&format!("plugins_{call}/none"));
        let pass = median(&format!("plugins_{call}/{}", case.call.floor())) - none;
        let cost = median(&format!("plugins_{call}/{}", case.plugin)) - none;
        let size = std::fs::metadata(guest(case.plugin))
            .map(|m| m.len())
            .unwrap_or(0);
        println!(
            "| {} | {call} | {} KiB | {:.1} | {:.1}x |",
            case.plugin,
            size / 1024,
            cost / 1e3,
            cost / pass
        );
    }
}
