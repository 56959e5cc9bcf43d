//! Fuzzing the loader: real components with random bytes changed must be
//! refused with a `LoadError` or load and run, never crash or hang the
//! host. CI runs a few dozen cases; `scripts/fuzz` runs many more
//! (`SHALLOT_FUZZ_CASES`).

use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::json;
use shallot::{Context, Engine, EngineConfig, FilterSpec, Kernel, PluginSet};
use shallot_tests::{ScriptedModel, ask, guest};

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
        let Ok(plugins) = PluginSet::from_specs(&engine(), vec![(path, spec)], &mut |_| {}).await
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
