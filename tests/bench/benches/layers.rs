//! What one wasm filter layer costs: a chat invoke through 0, 1, 4 and 16
//! pass-through layers, wasm (warm instances) and native Rust closures, at
//! 1 KiB and 64 KiB of conversation, against a bare component call (an
//! export that does nothing) measured in the same run.

use std::time::Instant;

use criterion::{BenchmarkId, Criterion};
use shallot_bench::{
    conversation, criterion, median, native_kernel, report_failures, runtime, time_chats,
    wasm_kernel,
};
use shallot_tests::{engine, guest};
use tokio::runtime::Runtime;

const LAYERS: [usize; 4] = [0, 1, 4, 16];
const SIZES: [(&str, usize); 2] = [("1KiB", 1024), ("64KiB", 64 * 1024)];

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

fn bench_chat(c: &mut Criterion, rt: &Runtime) {
    for (label, bytes) in SIZES {
        let request = conversation(bytes);
        let mut group = c.benchmark_group(format!("chat/{label}"));
        for layers in LAYERS {
            let kernel = wasm_kernel(rt, "passthrough", layers);
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

fn main() {
    let rt = runtime();
    let mut c = criterion();
    bench_bare_call(&mut c, &rt);
    bench_chat(&mut c, &rt);
    c.final_summary();
    report();
    report_failures();
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
}
