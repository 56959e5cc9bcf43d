//! Compiling plugins, in a child process with a memory cap and a deadline.
//!
//! Cranelift's time and memory grow with what a component holds, so a
//! hostile file could make the host compile for minutes or take gigabytes.
//! The loader checks the file's shape first (`plugin::loader`); what is left
//! is bounded here: the compile runs in a child process (this same
//! executable, re-run in worker mode) under `RLIMIT_AS`, and is killed at a
//! deadline. The worker sends back the compiled artifact, which the host
//! loads as it would a cache entry.
//!
//! Worker mode is entered before `main` (an `.init_array` function of this
//! library), so it works from any executable that links shallot: the
//! `shallot` command, a test binary, an embedder's program. On platforms
//! other than Linux the compile runs in the host process.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use wasmtime::component::Component;

/// The environment variable that puts a process in worker mode; its value
/// is the address-space cap in MiB.
const WORKER: &str = "SHALLOT_COMPILE_WORKER";
/// The worker's exit code for a component the compiler refused.
const REFUSED: i32 = 3;

/// The code-generation settings of every engine and every worker: the
/// artifacts a worker makes load only into an engine configured alike.
pub(crate) fn config() -> wasmtime::Config {
    let mut config = wasmtime::Config::new();
    config
        .wasm_component_model(true)
        .epoch_interruption(true)
        .concurrency_support(false);
    config
}

/// Why a compile failed.
#[derive(Debug)]
pub(crate) enum CompileError {
    /// The compiler refused the component (it is not valid).
    Invalid(String),
    /// The compile went past its memory cap or its deadline.
    Limit(String),
}

/// Compiles `bytes` for `engine` in a worker process capped at
/// `memory_mib` of address space and `timeout` of wall time.
pub(crate) fn compile(
    engine: &wasmtime::Engine,
    bytes: &[u8],
    memory_mib: u32,
    timeout: Duration,
) -> Result<Component, CompileError> {
    if !cfg!(target_os = "linux") {
        return Component::new(engine, bytes).map_err(|e| CompileError::Invalid(format!("{e:#}")));
    }
    let exe = std::env::current_exe()
        .map_err(|e| CompileError::Limit(format!("cannot start the compile worker: {e}")))?;
    let mut child = Command::new(exe)
        .env(WORKER, memory_mib.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CompileError::Limit(format!("cannot start the compile worker: {e}")))?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let input = bytes.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        out
    });
    let errors = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = stderr.read_to_string(&mut out);
        out
    });
    let status = wait_within(&mut child, timeout);
    let _ = writer.join();
    let artifact = reader.join().unwrap_or_default();
    let said = errors.join().unwrap_or_default();
    let Some(status) = status else {
        return Err(CompileError::Limit(format!(
            "did not compile within {} s",
            timeout.as_secs_f32()
        )));
    };
    match status.code() {
        Some(0) => {
            // SAFETY: the artifact was made just now by this executable in
            // worker mode, from `config()`, for this engine's settings.
            unsafe { Component::deserialize(engine, &artifact) }
                .map_err(|e| CompileError::Limit(format!("the compile worker's output: {e:#}")))
        }
        Some(REFUSED) => Err(CompileError::Invalid(said.trim().to_owned())),
        _ => Err(CompileError::Limit(format!(
            "compiling it took more than {memory_mib} MiB of memory (the compile worker died: {status})"
        ))),
    }
}

/// Waits for `child` to exit, at most `timeout`; past it, kills it and
/// gives `None`.
fn wait_within(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Worker mode: runs before `main` when [`WORKER`] is set, compiles the
/// component on stdin to stdout and exits.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static WORKER_ENTRY: extern "C" fn() = worker;

#[cfg(target_os = "linux")]
extern "C" fn worker() {
    let Some(cap) = std::env::var_os(WORKER) else {
        return;
    };
    let mib: u64 = cap.to_str().and_then(|c| c.parse().ok()).unwrap_or(4096);
    let limit = libc::rlimit {
        rlim_cur: mib << 20,
        rlim_max: mib << 20,
    };
    // SAFETY: setrlimit with a valid pointer to an initialised rlimit.
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    let mut bytes = Vec::new();
    if std::io::stdin().read_to_end(&mut bytes).is_err() {
        std::process::exit(1);
    }
    let compiled =
        wasmtime::Engine::new(&config()).and_then(|engine| engine.precompile_component(&bytes));
    match compiled {
        Ok(artifact) => {
            let written = std::io::stdout().write_all(&artifact);
            std::process::exit(if written.is_ok() { 0 } else { 1 });
        }
        Err(e) => {
            eprint!("{e:#}");
            std::process::exit(REFUSED);
        }
    }
}
