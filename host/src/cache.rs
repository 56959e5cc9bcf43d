//! The compile cache: each plugin is compiled once per engine build and
//! kept on disk, keyed by the SHA-256 of its bytes and the engine's
//! compatibility hash.
//!
//! The cache is the host's own directory (by default
//! `$XDG_CACHE_HOME/shallot` or `~/.cache/shallot`). Loading a precompiled
//! artifact skips validation, so the host never loads one from anywhere
//! else, in particular never from the plugins directory: the cache must be
//! as trusted as the `shallot` binary itself.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;

/// Whether a plugin's compiled form is in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// Compiled earlier; loading takes about a tenth of a millisecond.
    Cached,
    /// Not compiled yet for this engine; the first load compiles it.
    Missing,
    /// The cache is turned off.
    Disabled,
}

impl CacheState {
    /// A short word for listings.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheState::Cached => "cached",
            CacheState::Missing => "not compiled",
            CacheState::Disabled => "no cache",
        }
    }
}

/// The on-disk compile cache.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    /// One lock per entry: a second loader of a plugin that is compiling
    /// waits for the first and reads its result instead of compiling it
    /// again (a Python component costs seconds of CPU).
    compiling: Arc<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>>,
}

impl Cache {
    /// A cache in `dir` (created on first write).
    pub fn new(dir: PathBuf) -> Self {
        Cache {
            dir,
            compiling: Arc::default(),
        }
    }

    /// `$SHALLOT_CACHE_DIR`, else `$XDG_CACHE_HOME/shallot`, else `~/.cache/shallot`.
    pub fn default_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("SHALLOT_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("shallot"));
        }
        std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache").join("shallot"))
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, engine: &wasmtime::Engine, bytes: &[u8]) -> PathBuf {
        let mut compat = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut compat);
        let digest = Sha256::digest(bytes);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        self.dir
            .join(format!("{hex}-{:016x}.cwasm", compat.finish()))
    }

    /// Whether `bytes` are compiled for `engine`.
    pub fn state(&self, engine: &wasmtime::Engine, bytes: &[u8]) -> CacheState {
        if self.path(engine, bytes).is_file() {
            CacheState::Cached
        } else {
            CacheState::Missing
        }
    }

    /// Loads the compiled component for `bytes`, compiling it with
    /// `compile` and storing it first if needed. Returns whether it was
    /// compiled now.
    pub fn load<E>(
        &self,
        engine: &wasmtime::Engine,
        bytes: &[u8],
        compile: impl FnOnce() -> Result<Component, E>,
    ) -> Result<(Component, bool), E> {
        let path = self.path(engine, bytes);
        let entry = self
            .compiling
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(path.clone())
            .or_default()
            .clone();
        let _only_compiler = entry.lock().unwrap_or_else(PoisonError::into_inner);
        if path.is_file() {
            // SAFETY: the file is in the host's own cache directory, written
            // only by `store` below from `Component::serialize` of the same
            // engine configuration (the name carries its compatibility hash).
            if let Ok(component) = unsafe { Component::deserialize_file(engine, &path) } {
                return Ok((component, false));
            }
            tracing::warn!(path = %path.display(), "discarding unreadable compile-cache entry");
        }
        let component = compile()?;
        if let Err(e) = self.store(&path, &component) {
            tracing::warn!(path = %path.display(), "could not write the compile cache: {e:#}");
        }
        Ok((component, true))
    }

    fn store(&self, path: &Path, component: &Component) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let bytes = component
            .serialize()
            .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
        // Write then rename, so a reader never sees half a file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }
}
