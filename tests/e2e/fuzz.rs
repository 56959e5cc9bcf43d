//! Fuzzing the loader and the boundary. Real components with random bytes
//! changed must be refused with a `LoadError` or load and run; the chaos
//! guest, from a random seed, makes random calls across the WIT (forged and
//! stale handles, hostile strings, malformed token batches, random `next`
//! calls and results), and every chain must end in a value or a typed error
//! naming it, never crash or hang the host. CI runs a few dozen cases;
//! `scripts/fuzz` runs many more (`SHALLOT_FUZZ_CASES`).

use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::json;
use shallot::types::{Message, ToolSpec, TurnRequest, TurnResult};
use shallot::{
    ChainError, Context, Engine, EngineConfig, ErrorKind, FilterSet, FilterSpec, Kernel,
};
use shallot_tests::{Collector, Reply, ScriptedModel, ask, guest, load, spec};

/// An engine without a compile cache, so mutants leave nothing behind.
fn engine() -> Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            Engine::new(EngineConfig {
                cache_dir: None,
                instance_slots: 8,
                idle_instances: 8,
                ..EngineConfig::default()
            })
            .unwrap()
        })
        .clone()
}

fn cases() -> u32 {
    std::env::var("SHALLOT_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(24)
}

/// Loads `bytes` as a plugin and, if it loads, runs a chat through it.
fn load_and_run(bytes: &[u8]) {
    let dir = std::env::temp_dir().join(format!("shallot-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mutant.wasm");
    std::fs::write(&path, bytes).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let spec = FilterSpec {
            config: Some(json!({})),
            ..FilterSpec::default()
        };
        let Ok(plugins) = FilterSet::from_specs(&engine(), vec![(path, spec)], &mut |_| {}).await
        else {
            return;
        };
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(ScriptedModel::answer("fine"))
            .build()
            .unwrap();
        let _ = kernel.chat(ask("hi"), Context::new()).await;
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn a_mutated_component_is_refused_or_runs(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<Option<prop::sample::Index>>(),
    ) {
        let mut bytes = std::fs::read(guest("probe")).unwrap();
        for (at, byte) in flips {
            let at = at.index(bytes.len());
            bytes[at] = byte;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        load_and_run(&bytes);
    }
}

/// A chain's error must be typed and name the chaos filter (or a
/// terminal); an `internal` error the filter did not return itself means
/// the host let something through it should have caught.
fn contained(error: &ChainError) {
    match &error.origin {
        Some(origin) => assert!(
            &*origin.filter == "chaos" || origin.plugin.is_none(),
            "{error}"
        ),
        None => assert_ne!(error.kind, ErrorKind::Internal, "{error}"),
    }
}

async fn chaos(seed: u64, ops: u32) {
    let plugins = load(vec![spec(
        "chaos",
        "chaos",
        json!({ "seed": seed, "ops": ops }),
    )])
    .await;
    // It names each hook 10,000 times; every invoke reads the list.
    assert_eq!(plugins.filters()[0].hooks().len(), 5);
    let model = ScriptedModel::replies(vec![
        Reply::call("echo", json!({ "x": 1 })),
        Reply::tokens(&["a", "b", "c"]),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model)
        .tool(ToolSpec::new("echo", "", json!({})), |args, _| async move {
            Ok(args)
        })
        .build()
        .unwrap();
    if let Err(e) = kernel.chat(ask("hi"), Context::new()).await {
        contained(&e);
    }
    let stream = kernel.chat_stream(ask("hi"), Context::new(), Collector::default());
    if let Err(e) = stream.await {
        contained(&e);
    }
    if let Err(e) = kernel.tool("echo", json!({ "x": 2 }), Context::new()).await {
        contained(&e);
    }
    let turn = TurnRequest::new(vec![Message::user("go")]);
    if let TurnResult::Error(e) = kernel.turn(turn, Context::new()).await {
        contained(&e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_calls_across_the_boundary_end_in_values_or_typed_errors(
        seed in 1u64..u64::MAX,
        ops in 0u32..24,
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(chaos(seed, ops));
        let innocent = runtime.block_on(load(vec![spec("probe", "p", json!({}))]));
        let kernel = Kernel::builder().plugins(&innocent).build().unwrap();
        prop_assert!(runtime.block_on(kernel.chat(ask("hi"), Context::new())).is_ok());
    }
}
