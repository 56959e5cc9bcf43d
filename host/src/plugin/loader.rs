//! Loading one plugin file: check what it is, compile it (through the
//! cache), check it speaks our WIT version, link it, and configure a filter
//! from it. Every way a file can be wrong has its own clear message.

use std::path::Path;
use std::sync::Arc;

use wasmtime::component::Component;
use wasmtime::component::types::ComponentItem;

use crate::compile::CompileError;

use super::Grants;
use super::bindings::FilterPre;
use super::filter::{Isolation, WasmFilter};
use super::host::{GrantedServices, HostState, Identity};
use super::instance::{Description, FilterInstance, InstanceTemplate};
use super::stats::Stats;
use crate::cache::CacheState;
use crate::engine::{Engine, MAX_MEMORY_MIB};
use crate::sandbox::Limits;

use super::error::LoadError;

/// The WIT package filters are built against.
pub const WIT_PACKAGE: &str = "shallot:filter";
/// The version of it this host speaks; components built for a compatible
/// version (same major, and same minor while the major is 0) load.
pub const WIT_VERSION: &str = "0.1.5";

/// A compiled and linked plugin file.
pub struct Plugin {
    path: Arc<Path>,
    size: u64,
    pre: FilterPre<HostState>,
    compiled: bool,
    /// Whether it imports `next.pass-on` (built for 0.1.1 or later).
    declares: bool,
}

impl Plugin {
    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether this load compiled it (a cache miss).
    pub fn was_compiled(&self) -> bool {
        self.compiled
    }
}

/// Reads a plugin file and checks that it is a component, without compiling.
pub fn read_plugin(path: &Path) -> Result<Vec<u8>, LoadError> {
    let bytes = std::fs::read(path).map_err(|error| LoadError::Read {
        path: path.into(),
        error,
    })?;
    if bytes.is_empty() {
        return Err(LoadError::Empty { path: path.into() });
    }
    if !bytes.starts_with(b"\0asm") || bytes.len() < 8 {
        return Err(LoadError::NotWasm { path: path.into() });
    }
    // Bytes 4..8: version 1 for a core module, 0x0d + layer 1 for a component.
    if bytes[4..8] == [1, 0, 0, 0] {
        return Err(LoadError::CoreModule { path: path.into() });
    }
    Ok(bytes)
}

/// Whether `bytes` are compiled in `engine`'s cache.
pub fn cache_state(engine: &Engine, bytes: &[u8]) -> CacheState {
    match engine.cache() {
        Some(cache) => cache.state(engine.wasmtime(), bytes),
        None => CacheState::Disabled,
    }
}

/// What a component may hold before it is compiled: compile time and
/// memory grow with these, so a file past them is refused unread by the
/// compiler (the Python and JavaScript runtimes stay well inside).
const MAX_BYTES: usize = 64 << 20;
const MAX_FUNCTIONS: usize = 150_000;
const MAX_FUNCTION_BYTES: usize = 1 << 20;
const MAX_LOCALS: u32 = 50_000;
const MAX_NESTING: u32 = 1_000;

/// Checks the bounds above without compiling anything.
fn check_size(path: &Path, bytes: &[u8]) -> Result<(), LoadError> {
    match bounds(bytes) {
        Ok(()) => Ok(()),
        Err(Bound::Invalid(e)) => Err(LoadError::Invalid {
            path: path.into(),
            message: e.to_string(),
        }),
        Err(Bound::Over(message)) => Err(LoadError::TooLarge {
            path: path.into(),
            message,
        }),
    }
}

/// Why [`bounds`] refused a file.
enum Bound {
    Invalid(wasmparser::BinaryReaderError),
    Over(String),
}

impl From<wasmparser::BinaryReaderError> for Bound {
    fn from(e: wasmparser::BinaryReaderError) -> Self {
        Bound::Invalid(e)
    }
}

fn bounds(bytes: &[u8]) -> Result<(), Bound> {
    let over = |message: String| Err(Bound::Over(message));
    if bytes.len() > MAX_BYTES {
        return over(format!(
            "it has {} bytes; a filter may have at most {MAX_BYTES}",
            bytes.len()
        ));
    }
    let mut functions = 0;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        let wasmparser::Payload::CodeSectionEntry(body) = payload? else {
            continue;
        };
        functions += 1;
        if functions > MAX_FUNCTIONS {
            return over(format!("it has more than {MAX_FUNCTIONS} functions"));
        }
        let size = body.range().len();
        if size > MAX_FUNCTION_BYTES {
            return over(format!(
                "function {functions} has {size} bytes of code; the most is {MAX_FUNCTION_BYTES}"
            ));
        }
        let mut locals = 0u32;
        for group in body.get_locals_reader()? {
            let (count, _) = group?;
            locals = locals.saturating_add(count);
        }
        if locals > MAX_LOCALS {
            return over(format!(
                "function {functions} has {locals} locals; the most is {MAX_LOCALS}"
            ));
        }
        let mut depth = 0u32;
        let mut operators = body.get_operators_reader()?;
        while !operators.eof() {
            use wasmparser::Operator as Op;
            match operators.read()? {
                Op::Block { .. } | Op::Loop { .. } | Op::If { .. } | Op::TryTable { .. } => {
                    depth += 1;
                    if depth > MAX_NESTING {
                        return over(format!(
                            "function {functions} nests blocks deeper than {MAX_NESTING}"
                        ));
                    }
                }
                Op::End => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
    }
    Ok(())
}

/// Compiles (or loads from the cache) and links a plugin. Blocking and, on
/// a cache miss, slow for big guests: run it off the async executor. A
/// file not in the cache is first checked against the size bounds.
pub fn compile_plugin(engine: &Engine, path: &Path, bytes: &[u8]) -> Result<Plugin, LoadError> {
    let invalid = |e: wasmtime::Error| LoadError::Invalid {
        path: path.into(),
        message: format!("{e:#}"),
    };
    if cache_state(engine, bytes) != CacheState::Cached {
        check_size(path, bytes)?;
    }
    let compile = || engine.compile(bytes);
    let (component, compiled) = match engine.cache() {
        Some(cache) => cache.load(engine.wasmtime(), bytes, compile),
        None => compile().map(|component| (component, true)),
    }
    .map_err(|e| match e {
        CompileError::Invalid(message) => LoadError::Invalid {
            path: path.into(),
            message,
        },
        CompileError::Limit(message) => LoadError::CompileLimit {
            path: path.into(),
            message,
        },
    })?;
    check_contract(engine, path, &component)?;
    let declares = imports_pass_on(engine, &component);
    let linker = super::host::linker(engine.wasmtime()).map_err(invalid)?;
    let pre = linker
        .instantiate_pre(&component)
        .map_err(|e| LoadError::UnknownImport {
            path: path.into(),
            message: format!("{e:#}"),
        })?;
    let pre = FilterPre::new(pre).map_err(|e| LoadError::NotAFilter {
        path: path.into(),
        exports: format!("mismatched exports ({e:#})"),
    })?;
    Ok(Plugin {
        path: path.into(),
        size: bytes.len() as u64,
        pre,
        compiled,
        declares,
    })
}

/// Whether the component imports `next.pass-on`, with which it declares
/// the inner errors it passes on (see `HostState::attribute`).
fn imports_pass_on(engine: &Engine, component: &Component) -> bool {
    let next = format!("{WIT_PACKAGE}/next@");
    let wasmtime = engine.wasmtime();
    component
        .component_type()
        .imports(wasmtime)
        .any(|(name, item)| match item.ty {
            ComponentItem::ComponentInstance(instance) if name.starts_with(&next) => instance
                .exports(wasmtime)
                .any(|(function, _)| function == "pass-on"),
            _ => false,
        })
}

/// Whether `version` (of our package) is compatible with [`WIT_VERSION`].
fn compatible(version: &str) -> bool {
    let parts = |v: &str| -> Option<(u64, u64)> {
        let mut it = v.split('.');
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    };
    match (parts(version), parts(WIT_VERSION)) {
        (Some((major, minor)), Some((our_major, our_minor))) => {
            major == our_major && (major != 0 || minor == our_minor)
        }
        _ => false,
    }
}

/// Checks, by name, that the component is a filter of our WIT version, so
/// a mismatch gets a message naming both versions.
fn check_contract(engine: &Engine, path: &Path, component: &Component) -> Result<(), LoadError> {
    let ty = component.component_type();
    let exports: Vec<String> = ty
        .exports(engine.wasmtime())
        .map(|(name, _)| name.to_owned())
        .collect();
    let imports: Vec<String> = ty
        .imports(engine.wasmtime())
        .map(|(name, _)| name.to_owned())
        .collect();
    let ours = |name: &str| -> Option<String> {
        let rest = name.strip_prefix(WIT_PACKAGE)?.strip_prefix('/')?;
        rest.split_once('@').map(|(_, version)| version.to_owned())
    };
    let plugin_export = format!("{WIT_PACKAGE}/plugin@");
    if exports
        .iter()
        .any(|name| name.starts_with(&plugin_export) && ours(name).is_some_and(|v| compatible(&v)))
    {
        return Ok(());
    }
    if let Some(version) = exports
        .iter()
        .chain(&imports)
        .filter_map(|name| ours(name))
        .find(|v| !compatible(v))
    {
        return Err(LoadError::WrongVersion {
            path: path.into(),
            found: format!("{WIT_PACKAGE}@{version}"),
        });
    }
    let exports = if exports.is_empty() {
        "nothing".to_owned()
    } else {
        exports.join(", ")
    };
    Err(LoadError::NotAFilter {
        path: path.into(),
        exports,
    })
}

/// How an operator configured one filter.
#[derive(Debug, Clone, Default)]
pub struct FilterSpec {
    /// The filter's name: 1 to 64 of a-z and 0-9 in runs joined by single
    /// `-`. `None` takes its plugin file's (`rate_limit.wasm` is
    /// `rate-limit`), never the name the plugin gives itself: a name keys
    /// what isolates a filter (its `kv` namespace, its metric families,
    /// the lines it is blamed for), so the operator or the host gives it.
    pub name: Option<String>,
    /// The configuration handed to the plugin's `configure`.
    pub config: Option<serde_json::Value>,
    /// Its resource limits.
    pub limits: Limits,
    /// What it is granted beyond nothing.
    pub grants: Grants,
    /// How its instances are shared.
    pub isolation: Isolation,
    /// Where this configuration comes from, for errors: a sidecar file, or a
    /// `shallot.toml` and the line of its `[[filter]]`.
    pub source: Option<String>,
}

/// Configures a filter from a compiled plugin: instantiates it once to run
/// `configure` (so a bad configuration fails here, not on a request) and
/// `describe`.
pub async fn configure_filter(
    engine: &Engine,
    plugin: Arc<Plugin>,
    spec: FilterSpec,
) -> Result<Arc<WasmFilter>, LoadError> {
    let path = plugin.path.to_path_buf();
    let limits = spec.limits;
    if let Err(message) = limits.check(MAX_MEMORY_MIB) {
        return Err(LoadError::Limits { path, message });
    }
    let config: Arc<str> = spec
        .config
        .as_ref()
        .map_or_else(|| "null".to_owned(), |c| c.to_string())
        .into();
    let services = GrantedServices::open(&spec.grants)
        .await
        .map_err(|message| LoadError::Config {
            path: path.clone(),
            message,
        })?;
    let name: Arc<str> = spec.name.unwrap_or_else(|| name_of_file(&path)).into();
    if let Err(message) = check_name(&name) {
        return Err(LoadError::Config { path, message });
    }
    let template = InstanceTemplate {
        pre: plugin.pre.clone(),
        identity: Arc::new(Identity {
            name: name.clone(),
            plugin: plugin.path.clone(),
            stats: Stats::default(),
        }),
        limits,
        grants: spec.grants,
        services,
        config,
        declares: plugin.declares,
    };
    let description = describe(engine, &template, &path, &spec.source).await?;
    Ok(Arc::new(WasmFilter::new(
        name,
        plugin,
        template,
        description,
        spec.isolation,
        engine.clone(),
    )))
}

/// Makes one instance of `template` in an engine slot, configured, and
/// asks it to describe itself.
async fn describe(
    engine: &Engine,
    template: &InstanceTemplate,
    path: &Path,
    source: &Option<String>,
) -> Result<Description, LoadError> {
    let failed = |error| LoadError::Filter {
        path: path.to_path_buf(),
        error: Box::new(error),
        configured_in: source.clone(),
    };
    let _slot = engine
        .slots()
        .acquire()
        .await
        .map_err(|e| LoadError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let mut instance = FilterInstance::create(template).await.map_err(failed)?;
    instance.describe().await.map_err(failed)
}

/// The longest filter name.
const NAME_CAP: usize = 64;

/// The name a plugin file gives its filter: its stem in lowercase, each
/// run of other characters than a-z and 0-9 one `-` (`token_redact.wasm`
/// is `token-redact`, as the built-ins call themselves).
fn name_of_file(path: &Path) -> String {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let lower = stem.to_lowercase();
    let runs = lower.split(|c: char| !c.is_ascii_lowercase() && !c.is_ascii_digit());
    runs.filter(|run| !run.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// Checks a filter's name: 1 to [`NAME_CAP`] of a-z and 0-9 in runs
/// joined by single `-`, so that its metric families are its own (a
/// name's `-` is `_` in them, and `__` parts it from the metric's).
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= NAME_CAP
        && name.split('-').all(|run| {
            !run.is_empty()
                && run
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the filter's name `{}` must be 1 to {NAME_CAP} of a-z and 0-9 in runs joined by single `-` (set `name`)",
            crate::escape::printable(name, NAME_CAP)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{check_name, compatible, name_of_file};
    use std::path::Path;

    #[test]
    fn a_files_name_is_its_stem_in_lowercase_runs_joined_by_dashes() {
        for (file, name) in [
            ("plugins/token_redact.wasm", "token-redact"),
            ("10-first.wasm", "10-first"),
            ("My  Filter.v2.wasm", "my-filter-v2"),
            ("__odd__.wasm", "odd"),
        ] {
            assert_eq!(name_of_file(Path::new(file)), name);
            assert!(check_name(name).is_ok(), "{name}");
        }
    }

    #[test]
    fn a_name_is_runs_of_a_z_and_0_9_joined_by_single_dashes() {
        for bad in [
            "",
            "Guard",
            "a--b",
            "-a",
            "a-",
            "a_b",
            "a b",
            &"x".repeat(65),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_the_same_minor_is_compatible_before_1_0() {
        assert!(compatible("0.1.0"));
        assert!(compatible("0.1.7"));
        assert!(!compatible("0.2.0"));
        assert!(!compatible("1.1.0"));
        assert!(!compatible("garbage"));
    }
}
