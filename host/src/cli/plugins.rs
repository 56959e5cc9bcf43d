//! `shallot plugins`: list a plugin set, check one plugin file, show the
//! presets.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use shallot::{
    CacheState, Call, Engine, FilterSet, FilterSpec, Hook, LoadError, LoadEvent, PRESETS,
    WIT_PACKAGE, WIT_VERSION, WasmFilter, cache_state, preset, read_config, read_dir, read_plugin,
};

use super::{Source, human_size, report};

#[derive(Subcommand)]
pub(crate) enum PluginsCommand {
    /// List the filters a plugins directory or shallot.toml resolves to, in
    /// layer order (first = outermost), with hooks, version, size and
    /// compile-cache state, then those that need a configuration they were
    /// not given, with what they said they need. Compiles what is not
    /// cached yet.
    List {
        #[command(flatten)]
        source: Source,
    },
    /// The presets a `[[filter]]` table can name (`preset = "NAME"`), with
    /// their filters and configurations.
    Presets,
    /// Check that FILE is a filter component for this host's WIT version,
    /// configure it, and show what it implements. A filter that needs a
    /// configuration and was given none says what it needs (exit 1).
    Check {
        /// The .wasm file.
        file: PathBuf,
        /// Configuration to check it with, as JSON.
        #[arg(long, value_name = "JSON")]
        with_config: Option<String>,
    },
}

pub(crate) async fn run(engine: &Engine, command: PluginsCommand) -> anyhow::Result<ExitCode> {
    match command {
        PluginsCommand::List { source } => list(engine, source).await,
        PluginsCommand::Check { file, with_config } => check(engine, file, with_config).await,
        PluginsCommand::Presets => Ok(presets()),
    }
}

async fn list(engine: &Engine, source: Source) -> anyhow::Result<ExitCode> {
    let specs = match (&source.plugins, &source.config) {
        (Some(dir), _) => read_dir(dir)?,
        (_, Some(file)) => read_config(file)?,
        (None, None) => anyhow::bail!("give --plugins DIR or --config FILE"),
    };
    let mut before: HashMap<PathBuf, CacheState> = HashMap::new();
    for (path, _) in &specs {
        if let Ok(bytes) = read_plugin(path) {
            before.insert(path.clone(), cache_state(engine, &bytes));
        }
    }
    let mut compile_times = HashMap::new();
    let mut progress = |event: LoadEvent<'_>| {
        report(&event);
        if let LoadEvent::Loaded {
            filter,
            compile_time: Some(t),
        } = event
        {
            compile_times.insert(filter.plugin().path().to_path_buf(), t);
        }
    };
    let (set, unconfigured) =
        match FilterSet::from_specs(engine, specs.clone(), &mut progress).await {
            Ok(set) => (set, Vec::new()),
            Err(error) if wants_configuration(&error) => {
                let (ready, unconfigured) = configurable(engine, specs).await;
                (
                    FilterSet::from_specs(engine, ready, &mut progress).await?,
                    unconfigured,
                )
            }
            Err(error) => return Err(error.into()),
        };
    print_table(&set, &before, &compile_times);
    for (path, error) in &unconfigured {
        if let (LoadError::Filter { error: e, .. }, Some(says)) = (error, needs(error)) {
            let name = e.origin.as_ref().map_or("?", |o| &*o.filter);
            println!(
                "-   {name:<16} needs a configuration: {says}  {}",
                path.display()
            );
        }
    }
    print_chains(&set);
    Ok(ExitCode::SUCCESS)
}

/// A line for each filter of `set`: its place, name, hooks, version,
/// size, isolation, compile-cache state (as it was `before` loading, or
/// how long it took to compile now) and file.
fn print_table(
    set: &FilterSet,
    before: &HashMap<PathBuf, CacheState>,
    compile_times: &HashMap<PathBuf, Duration>,
) {
    println!(
        "{:<3} {:<16} {:<40} {:<8} {:>10} {:<9} {:<20} PLUGIN",
        "#", "NAME", "HOOKS", "VERSION", "SIZE", "ISOLATION", "CACHE"
    );
    for (i, filter) in set.filters().iter().enumerate() {
        let path = filter.plugin().path();
        let hooks: Vec<&str> = filter.hooks().iter().map(|h| h.as_str()).collect();
        let cache = match (before.get(path), compile_times.get(path)) {
            (_, Some(t)) => format!("compiled now ({:.1} s)", t.as_secs_f64()),
            (Some(state), None) => state.as_str().to_owned(),
            (None, None) => "?".to_owned(),
        };
        println!(
            "{:<3} {:<16} {:<40} {:<8} {:>10} {:<9} {:<20} {}",
            i + 1,
            filter.name(),
            if hooks.is_empty() {
                "-".to_owned()
            } else {
                hooks.join(",")
            },
            filter.version(),
            human_size(filter.plugin().size()),
            filter.isolation().as_str(),
            cache,
            path.display(),
        );
    }
}

fn presets() -> ExitCode {
    for (name, about) in PRESETS {
        println!("{name}: {about}");
        for (plugin, spec) in preset(name).unwrap_or_default() {
            let config = spec.config.unwrap_or_default();
            let mut grants = Vec::new();
            if spec.grants.sleep_ms > 0 {
                grants.push(format!("sleep_ms = {}", spec.grants.sleep_ms));
            }
            if spec.grants.approval {
                grants.push("approval = true".to_owned());
            }
            let grants = if grants.is_empty() {
                String::new()
            } else {
                format!("  grants {{ {} }}", grants.join(", "))
            };
            println!("  {plugin:<18} {config}{grants}");
        }
    }
    ExitCode::SUCCESS
}

/// Whether `error` is a filter refusing the configuration it was given
/// (or the lack of one), rather than a plugin that cannot load.
fn wants_configuration(error: &LoadError) -> bool {
    matches!(error, LoadError::Filter { error, .. }
        if error.origin.as_ref().is_some_and(|o| o.call == Call::Configure))
}

/// What a filter that refused its configuration (`error`) said it needs,
/// safe for a terminal.
fn needs(error: &LoadError) -> Option<String> {
    let LoadError::Filter { error, .. } = error else {
        return None;
    };
    let says = error
        .message
        .trim_start_matches("rejected its configuration: ");
    Some(shallot::terminal_text(says))
}

/// The specs that configure (any other failure is the whole set's again),
/// and the refusals of those that do not.
async fn configurable(
    engine: &Engine,
    specs: Vec<(PathBuf, FilterSpec)>,
) -> (Vec<(PathBuf, FilterSpec)>, Vec<(PathBuf, LoadError)>) {
    let (mut ready, mut unconfigured) = (Vec::new(), Vec::new());
    for (path, spec) in specs {
        match FilterSet::from_specs(engine, vec![(path.clone(), spec.clone())], &mut |_| {}).await {
            Err(error) if wants_configuration(&error) => unconfigured.push((path, error)),
            _ => ready.push((path, spec)),
        }
    }
    (ready, unconfigured)
}

/// The resolved order of every chain, so nobody has to work it out.
fn print_chains(set: &FilterSet) {
    let with = |hook: Hook| -> Vec<&str> {
        set.filters()
            .iter()
            .filter(|filter| filter.hooks().contains(&hook))
            .map(|filter| filter.name())
            .collect()
    };
    let path = |mut names: Vec<&str>, first: Option<&'static str>, last: &'static str| {
        names.insert(0, first.unwrap_or_default());
        names.push(last);
        names.retain(|name| !name.is_empty());
        names.join(" -> ")
    };
    println!(
        "\nchains (the onions outermost first; tokens in list order, the first filter seeing the model's raw tokens):"
    );
    for (label, hook, last) in [
        ("system-prompt", Hook::SystemPrompt, "model"),
        ("turn", Hook::AroundTurn, "tool loop"),
        ("chat", Hook::AroundChat, "model"),
        ("tool", Hook::AroundTool, "tools"),
    ] {
        println!("  {label:<14} {}", path(with(hook), None, last));
    }
    let tokens = path(with(Hook::TokenTransform), Some("model"), "caller");
    println!("  {:<14} {tokens}", "token");
}

async fn check(
    engine: &Engine,
    file: PathBuf,
    with_config: Option<String>,
) -> anyhow::Result<ExitCode> {
    let config = with_config
        .map(|text| {
            serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("--with-config is not JSON: {e}"))
        })
        .transpose()?;
    let given = config.is_some();
    let spec = FilterSpec {
        config,
        ..FilterSpec::default()
    };
    let loaded = FilterSet::from_specs(engine, vec![(file.clone(), spec)], &mut |event| {
        if let LoadEvent::Compiling { .. } = event {
            report(&event);
        }
    })
    .await;
    let set = match loaded {
        Ok(set) => set,
        Err(error) if !given && wants_configuration(&error) => {
            println!(
                "{} is a {WIT_PACKAGE}@{WIT_VERSION} filter that needs a configuration: {}",
                file.display(),
                needs(&error).unwrap_or_default()
            );
            println!("  check it with one: --with-config '{{...}}' (JSON)");
            return Ok(ExitCode::FAILURE);
        }
        Err(error) => return Err(error.into()),
    };
    describe(&file, &set.filters()[0]);
    Ok(ExitCode::SUCCESS)
}

/// What `check` shows of a filter that loaded from `file`.
fn describe(file: &Path, filter: &WasmFilter) {
    let hooks: Vec<&str> = filter.hooks().iter().map(|h| h.as_str()).collect();
    println!(
        "ok: {} is a {WIT_PACKAGE}@{WIT_VERSION} filter",
        file.display()
    );
    if filter.declared_name() == filter.name() {
        println!("  name     {}", filter.name());
    } else {
        println!(
            "  name     {} (its file's; it calls itself {:?}, which names nothing)",
            filter.name(),
            shallot::terminal_text(filter.declared_name())
        );
    }
    println!("  version  {}", filter.version());
    println!(
        "  hooks    {}",
        if hooks.is_empty() {
            "none (passes everything through)".to_owned()
        } else {
            hooks.join(", ")
        }
    );
    println!(
        "  init     {}",
        shallot::terminal_text(filter.init_fctx().as_ref())
    );
    println!("  size     {}", human_size(filter.plugin().size()));
}
