//! The `shallot` command: run chats through a plugin set, list and check plugins.

#![warn(clippy::too_many_lines)]

mod cli;

use mimalloc::MiMalloc;

// glibc's allocator trims and re-faults memory on the 64 KiB bodies that
// cross filter boundaries; mimalloc keeps per-layer cost flat.
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
