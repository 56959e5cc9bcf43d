//! What a token transform costs: streamed tokens through 0, 1 and 3
//! transforms that copy their tokens (`copy_tokens`: the SDK's own
//! `PassThrough` is left out of the descriptor and costs nothing), wasm and
//! native, one token per step and 64 per
//! step. And a whole answer shown through 1 and 3 (a gateway's JSON
//! answer): within the chat's invoke (`InvokeOptions::shown`) against the
//! chat and then a second invoke for the transforms (`delivered_text`).

use std::time::Instant;

use criterion::{BenchmarkId, Criterion};
use shallot::types::{FinishReason, TokenBatch};
use shallot::{Context, InvokeOptions};
use shallot_bench::{
    conversation, criterion, median, native_kernel, report_failures, runtime, survive, wasm_kernel,
};
use tokio::runtime::Runtime;

const TOKENS: usize = 4096;
const BATCHES: [usize; 2] = [1, 64];

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
            let mut kernels = vec![("wasm", wasm_kernel(rt, "copy_tokens", layers))];
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
                                survive(bench, stream.finish(FinishReason::Complete).await);
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

/// How a whole answer is shown: within its chat, or by a second invoke.
const SHOWN: [&str; 2] = ["within", "second-invoke"];

fn bench_shown(c: &mut Criterion, rt: &Runtime) {
    let request = conversation(1024);
    let mut group = c.benchmark_group("shown");
    for layers in [1, 3] {
        let kernel = wasm_kernel(rt, "copy_tokens", layers);
        for how in SHOWN {
            let bench = format!("shown/{how}/{layers}");
            let bench = bench.as_str();
            group.bench_with_input(BenchmarkId::new(how, layers), &layers, |b, _| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let request = request.clone();
                            if how == "within" {
                                let options = InvokeOptions::from(Context::new()).shown();
                                survive(bench, kernel.chat(request, options).await);
                                continue;
                            }
                            match kernel.chat(request, Context::new()).await {
                                Ok(response) => {
                                    let text = response.message.text();
                                    let shown = kernel.delivered_text(text, Context::new());
                                    survive(bench, shown.await);
                                }
                                failed => survive(bench, failed),
                            }
                        }
                        start.elapsed()
                    })
                })
            });
        }
    }
    group.finish();
}

fn main() {
    let rt = runtime();
    let mut c = criterion();
    bench_tokens(&mut c, &rt);
    bench_shown(&mut c, &rt);
    c.final_summary();
    report();
    report_failures();
}

fn report() {
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
    println!("\n| filters | shown within the chat µs | by a second invoke µs | within / second |");
    println!("|---|---|---|---|");
    for layers in [1, 3] {
        let within = median(&format!("shown/within/{layers}"));
        let second = median(&format!("shown/second-invoke/{layers}"));
        println!(
            "| {layers} | {:.2} | {:.2} | {:.2} |",
            within / 1e3,
            second / 1e3,
            within / second
        );
    }
}
