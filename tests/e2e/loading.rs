//! Loading plugins: every way a file can be wrong gets its own clear
//! error; directories and shallot.toml resolve to the documented order; a
//! configuration its filter refuses fails the load (`refused`, which the
//! tests of each built-in filter use).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use shallot::{
    CacheState, Context, FilterSet, FilterSpec, Kernel, LoadError, cache_state, compile_plugin,
    read_plugin,
};
use shallot_tests::{ScriptedModel, ask, engine, guest, spec, strings};

fn scratch(name: &str) -> PathBuf {
    let dir = shallot_tests::target_dir()
        .join("shallot-test-scratch")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn load_file(path: &Path) -> Result<FilterSet, LoadError> {
    FilterSet::from_specs(
        &engine(),
        vec![(path.to_path_buf(), FilterSpec::default())],
        &mut |_| {},
    )
    .await
}

/// The error loading `plugin` as filter `name` with `config` fails with.
pub(crate) async fn refused(plugin: &str, name: &str, config: Value) -> LoadError {
    let specs = vec![spec(plugin, name, config)];
    shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
        .await
        .err()
        .expect("the configuration is refused")
}

#[tokio::test]
async fn an_empty_file_is_refused() {
    let path = scratch("empty").join("empty.wasm");
    std::fs::write(&path, b"").unwrap();
    let error = load_file(&path).await.err().unwrap();
    assert!(matches!(error, LoadError::Empty { .. }), "{error}");
    assert!(error.to_string().contains("the file is empty"));
}

#[tokio::test]
async fn a_random_file_is_refused_as_not_webassembly() {
    let path = scratch("random").join("random.wasm");
    std::fs::write(
        &path,
        (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let error = load_file(&path).await.err().unwrap();
    assert!(matches!(error, LoadError::NotWasm { .. }), "{error}");
}

#[tokio::test]
async fn a_core_module_is_refused_with_how_to_make_a_component() {
    let path = scratch("core").join("core.wasm");
    std::fs::write(&path, b"\0asm\x01\0\0\0").unwrap();
    let error = load_file(&path).await.err().unwrap();
    assert!(matches!(error, LoadError::CoreModule { .. }), "{error}");
    assert!(error.to_string().contains("wasm32-wasip2"));
}

#[tokio::test]
async fn a_truncated_component_is_refused_as_invalid() {
    let bytes = std::fs::read(guest("passthrough")).unwrap();
    let path = scratch("truncated").join("truncated.wasm");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let error = load_file(&path).await.err().unwrap();
    assert!(matches!(error, LoadError::Invalid { .. }), "{error}");
}

#[tokio::test]
async fn a_component_of_another_world_is_not_a_filter() {
    let error = load_file(&guest("not_a_filter")).await.err().unwrap();
    assert!(matches!(error, LoadError::NotAFilter { .. }), "{error}");
    assert!(
        error.to_string().contains("wasi:cli/run"),
        "it names what the component does export: {error}"
    );
}

#[tokio::test]
async fn a_filter_for_another_wit_version_is_refused_naming_both_versions() {
    let error = load_file(&guest("wrong_version")).await.err().unwrap();
    assert!(matches!(error, LoadError::WrongVersion { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("shallot:filter@0.2.0") && message.contains("shallot:filter@0.1.5"),
        "{message}"
    );
}

#[tokio::test]
async fn a_missing_file_is_refused() {
    let error = load_file(Path::new("/nonexistent/filter.wasm"))
        .await
        .err()
        .unwrap();
    assert!(matches!(error, LoadError::Read { .. }), "{error}");
}

#[tokio::test]
async fn a_plugins_directory_layers_in_file_name_order_with_sidecar_configs() {
    let dir = scratch("dir");
    for (file, tag) in [("20-second", "second"), ("10-first", "first")] {
        std::fs::copy(guest("probe"), dir.join(format!("{file}.wasm"))).unwrap();
        std::fs::write(
            dir.join(format!("{file}.json")),
            json!({ "tag": tag }).to_string(),
        )
        .unwrap();
    }
    std::fs::write(dir.join("notes.txt"), "not a plugin").unwrap();
    let specs = shallot::read_dir(&dir).unwrap();
    let names: Vec<_> = specs
        .iter()
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["10-first.wasm", "20-second.wasm"]);
    // Both are the probe plugin, which calls itself `probe`: each is named
    // after its file, not after what the plugin says.
    let set = FilterSet::from_dir(&engine(), &dir, &mut |_| {})
        .await
        .unwrap();
    let names: Vec<&str> = set.filters().iter().map(|f| f.name()).collect();
    assert_eq!(names, ["10-first", "20-second"]);
    assert!(set.filters().iter().all(|f| f.declared_name() == "probe"));
}

/// A plugin used twice without names would be two filters of one name
/// (its file's): refused, saying how to fix it.
#[tokio::test]
async fn a_plugin_used_twice_without_names_is_refused_saying_how_to_fix_it() {
    let dir = scratch("twice");
    let config = dir.join("shallot.toml");
    let plugins = guest("probe").parent().unwrap().to_path_buf();
    let table = "[[filter]]\nplugin = \"probe.wasm\"\nconfig = { tag = \"t\" }\n";
    std::fs::write(&config, format!("plugin_dir = {plugins:?}\n{table}{table}")).unwrap();
    let error = FilterSet::from_config(&engine(), &config, &mut |_| {})
        .await
        .err()
        .unwrap();
    assert!(matches!(error, LoadError::DuplicateName { .. }), "{error}");
    assert!(
        error.to_string().contains("'probe'") && error.to_string().contains("shallot.toml"),
        "the message says how to fix it: {error}"
    );
}

#[tokio::test]
async fn shallot_toml_lists_filters_in_order_and_may_use_a_plugin_twice() {
    let dir = scratch("toml");
    let config = dir.join("shallot.toml");
    let plugins = guest("probe").parent().unwrap().to_path_buf();
    std::fs::write(
        &config,
        format!(
            r#"
plugin_dir = {plugins:?}

[[filter]]
name = "outer"
plugin = "probe.wasm"
config = {{ tag = "outer" }}

[[filter]]
name = "inner"
plugin = "probe.wasm"
config = {{ tag = "inner" }}
isolation = "warm"
limits = {{ memory_mib = 16, cpu_ms = 5000 }}
grants = {{ clock = true }}
"#
        ),
    )
    .unwrap();
    let set = FilterSet::from_config(&engine(), &config, &mut |_| {})
        .await
        .unwrap();
    let inner = &set.filters()[1];
    assert_eq!(inner.isolation(), shallot::Isolation::Warm);
    assert_eq!(
        (inner.limits().memory_mib, inner.limits().cpu_ms),
        (16, 5000)
    );
    assert!(inner.grants().clock);
    let kernel = Kernel::builder()
        .plugins(&set)
        .model(ScriptedModel::answer("ok").tracing())
        .build()
        .unwrap();
    let context = Context::new();
    kernel.chat(ask("hi"), context.clone()).await.unwrap();
    assert_eq!(
        strings(&context, "trace"),
        [
            "outer_before",
            "inner_before",
            "terminal",
            "inner_after",
            "outer_after"
        ]
    );
}

#[tokio::test]
async fn a_bad_shallot_toml_names_the_problem() {
    let dir = scratch("bad-toml");
    let config = dir.join("shallot.toml");
    std::fs::write(
        &config,
        "[[filter]]\nplugin = \"x.wasm\"\nisolaton = \"warm\"\n",
    )
    .unwrap();
    let error = FilterSet::from_config(&engine(), &config, &mut |_| {})
        .await
        .err()
        .unwrap();
    assert!(error.to_string().contains("isolaton"), "{error}");
}

#[tokio::test]
async fn compiled_plugins_come_from_the_cache_the_second_time() {
    let bytes = read_plugin(&guest("passthrough")).unwrap();
    let engine = engine();
    let first = compile_plugin(&engine, &guest("passthrough"), &bytes).unwrap();
    let second = compile_plugin(&engine, &guest("passthrough"), &bytes).unwrap();
    assert!(!second.was_compiled(), "the cache served it");
    let _ = first;
    assert_eq!(cache_state(&engine, &bytes), CacheState::Cached);
}

#[tokio::test]
async fn filter_names_must_be_unique_in_a_kernel() {
    let a = shallot_tests::load(vec![shallot_tests::spec("probe", "same", json!({}))]).await;
    let b = shallot_tests::load(vec![shallot_tests::spec("probe", "same", json!({}))]).await;
    let error = Kernel::builder()
        .plugins(&a)
        .plugins(&b)
        .build()
        .err()
        .unwrap();
    assert!(error.to_string().contains("'same'"), "{error}");
}

#[tokio::test]
async fn a_filter_that_joins_no_chain_and_an_empty_set_are_warned_about() {
    let mut warnings = Vec::new();
    let specs = vec![shallot_tests::spec("probe", "idle", json!({ "hooks": [] }))];
    let set = FilterSet::from_specs(&engine(), specs, &mut |event| {
        if let shallot::LoadEvent::Warning { message } = event {
            warnings.push(message.to_owned());
        }
    })
    .await
    .unwrap();
    assert_eq!(set.filters().len(), 1);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("filter 'idle'") && warnings[0].contains("joins no chain"));

    warnings.clear();
    let dir = scratch("empty-plugins");
    FilterSet::from_dir(&engine(), &dir, &mut |event| {
        if let shallot::LoadEvent::Warning { message } = event {
            warnings.push(message.to_owned());
        }
    })
    .await
    .unwrap();
    assert_eq!(
        warnings,
        ["no filters to load: requests pass through unfiltered"]
    );
}

#[tokio::test]
async fn a_sidecar_without_its_plugin_is_an_error() {
    let dir = scratch("orphan-sidecar");
    std::fs::write(dir.join("20-guard.json"), "{}").unwrap();
    let error = FilterSet::from_dir(&engine(), &dir, &mut |_| {})
        .await
        .err()
        .expect("refused");
    assert!(
        error
            .to_string()
            .contains("20-guard.json: configures a plugin that is not here"),
        "{error}"
    );
}

/// `guest` as if built for `shallot:filter@0.1.0`: its contract names
/// rewritten in place (the same length, so the binary stays valid).
fn built_for_0_1_0(name: &str) -> PathBuf {
    let mut bytes = std::fs::read(guest(name)).unwrap();
    let mut rewritten = 0;
    for at in 0..bytes.len().saturating_sub(6) {
        let named_ours = bytes[at.saturating_sub(48)..at]
            .windows(14)
            .any(|w| w == b"shallot:filter");
        if &bytes[at..at + 6] == b"@0.1.5" && named_ours {
            bytes[at + 5] = b'0';
            rewritten += 1;
        }
    }
    assert!(rewritten > 0, "{name} names the contract");
    let path = scratch("previous-patch").join(format!("{name}.wasm"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[tokio::test]
async fn a_filter_built_for_an_earlier_patch_version_still_loads_and_runs() {
    let old = built_for_0_1_0("misbehave");
    let as_filter = |name: &str, config| {
        (
            old.clone(),
            FilterSpec {
                name: Some(name.into()),
                config: Some(config),
                ..FilterSpec::default()
            },
        )
    };
    let plugins = FilterSet::from_specs(
        &engine(),
        vec![
            as_filter("outer", json!({ "on": "tool", "do": "mimic" })),
            as_filter(
                "bad",
                json!({ "on": "chat", "do": "error", "when": "fail" }),
            ),
        ],
        &mut |_| {},
    )
    .await
    .expect("0.1.0 is compatible with 0.1.5");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(ScriptedModel::answer("ok"))
        .build()
        .unwrap();
    let response = kernel.chat(ask("hi"), Context::new()).await.unwrap();
    assert_eq!(response.text(), "ok");
    let error = kernel.chat(ask("fail"), Context::new()).await.unwrap_err();
    assert_eq!(&*error.origin.expect("attributed").filter, "bad");
}

#[tokio::test]
async fn the_filters_without_options_and_trace_refuse_a_bad_configuration_at_load() {
    for (plugin, name, config, says) in [
        (
            "logging",
            "logging",
            json!({ "level": "debug" }),
            "unknown field `level`",
        ),
        (
            "final_answer",
            "final-answer",
            json!({ "tools": false }),
            "unknown field `tools`",
        ),
        ("trace", "trace", json!({ "turns": "yes" }), "invalid type"),
        (
            "trace",
            "trace",
            json!({ "sink": "stderr" }),
            "unknown field `sink`",
        ),
    ] {
        let error = refused(plugin, name, config).await;
        assert!(error.to_string().contains(says), "{plugin}: {error}");
    }
}
