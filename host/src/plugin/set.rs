//! A plugin set: the configured wasm filters, in layer order, loaded from
//! specs (which `crate::config` reads from a plugins directory or a
//! `shallot.toml`).

use std::collections::HashMap;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::LoadError;
use super::filter::WasmFilter;
use super::loader::{self, FilterSpec, Plugin};
use crate::engine::Engine;

/// Progress of a load, for a CLI to show on slow steps.
pub enum LoadEvent<'a> {
    /// A plugin has been compiling for a while (it was not in the cache):
    /// a big guest takes seconds. Quick compiles and cache hits are not
    /// announced.
    Compiling {
        /// The plugin file.
        path: &'a Path,
        /// Its size in bytes.
        size: u64,
    },
    /// A filter is configured and ready.
    Loaded {
        /// The filter.
        filter: &'a WasmFilter,
        /// How long its plugin took to compile, if this load compiled it.
        compile_time: Option<Duration>,
    },
    /// Something the operator should know that does not stop the load:
    /// no filters at all, a filter that joins no chain.
    Warning {
        /// What, in words.
        message: &'a str,
    },
}

/// Configured wasm filters, outermost first.
#[derive(Clone, Default)]
pub struct FilterSet {
    filters: Vec<Arc<WasmFilter>>,
}

impl FilterSet {
    /// Loads filters from plugin files and specs, in order. Each file is
    /// compiled once even if several filters use it.
    pub async fn from_specs(
        engine: &Engine,
        specs: Vec<(PathBuf, FilterSpec)>,
        progress: &mut (dyn FnMut(LoadEvent<'_>) + Send),
    ) -> Result<Self, LoadError> {
        if specs.is_empty() {
            progress(LoadEvent::Warning {
                message: "no filters to load: requests pass through unfiltered",
            });
        }
        let mut plugins: HashMap<PathBuf, (Arc<Plugin>, Option<Duration>)> = HashMap::new();
        let mut names = HashSet::new();
        let mut filters = Vec::with_capacity(specs.len());
        for (path, spec) in specs {
            let (plugin, compile_time) = match plugins.get(&path) {
                Some(loaded) => loaded.clone(),
                None => {
                    let loaded = compile(engine, &path, progress).await?;
                    plugins.insert(path.clone(), loaded.clone());
                    loaded
                }
            };
            let filter = loader::configure_filter(engine, plugin, spec).await?;
            if !names.insert(filter.name().to_owned()) {
                return Err(LoadError::DuplicateName {
                    name: filter.name().to_owned(),
                });
            }
            progress(LoadEvent::Loaded {
                filter: &filter,
                compile_time,
            });
            if filter.hooks().is_empty() {
                let message = format!(
                    "filter '{}' ({}) has no live hook with this configuration: it joins no chain",
                    filter.name(),
                    path.display()
                );
                progress(LoadEvent::Warning { message: &message });
            }
            filters.push(filter);
        }
        Ok(FilterSet { filters })
    }

    /// A set of already configured filters.
    pub fn new(filters: Vec<Arc<WasmFilter>>) -> Self {
        FilterSet { filters }
    }

    /// The filters, outermost first.
    pub fn filters(&self) -> &[Arc<WasmFilter>] {
        &self.filters
    }

    /// Whether a filter keeps conversations itself (it is granted a
    /// conversation store, as the `memory` filter is): the tool loop
    /// should then run without its own history, or every turn would send
    /// the history twice.
    pub fn keeps_conversations(&self) -> bool {
        self.filters.iter().any(|f| f.grants().memory.is_some())
    }
}

/// How long a compile runs before it is announced (`LoadEvent::Compiling`).
const SLOW_COMPILE: Duration = Duration::from_millis(500);

async fn compile(
    engine: &Engine,
    path: &Path,
    progress: &mut (dyn FnMut(LoadEvent<'_>) + Send),
) -> Result<(Arc<Plugin>, Option<Duration>), LoadError> {
    let bytes = loader::read_plugin(path)?;
    let size = bytes.len() as u64;
    let started = Instant::now();
    let (engine, owned) = (engine.clone(), path.to_path_buf());
    let mut task =
        tokio::task::spawn_blocking(move || loader::compile_plugin(&engine, &owned, &bytes));
    let joined = match tokio::time::timeout(SLOW_COMPILE, &mut task).await {
        Ok(joined) => joined,
        Err(_) => {
            progress(LoadEvent::Compiling { path, size });
            task.await
        }
    };
    let plugin = joined.map_err(|e| LoadError::Invalid {
        path: path.into(),
        message: format!("compilation panicked: {e}"),
    })??;
    let compile_time = plugin.was_compiled().then(|| started.elapsed());
    Ok((Arc::new(plugin), compile_time))
}
