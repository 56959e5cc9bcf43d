//! What a filter costs per language: one pass-through chat layer written in
//! Rust, Python and JavaScript (the same probe filter, through each
//! language's SDK), warm and with a fresh instance made per invoke.

use criterion::{BenchmarkId, Criterion};
use serde_json::json;
use shallot::Kernel;
use shallot_bench::{conversation, criterion, median, model, report_failures, runtime, time_chats};
use shallot_tests::{engine, spec, target_dir, warm};
use tokio::runtime::Runtime;

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

fn main() {
    let rt = runtime();
    let mut c = criterion();
    bench_languages(&mut c, &rt);
    c.final_summary();
    report();
    report_failures();
}

fn report() {
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
}
