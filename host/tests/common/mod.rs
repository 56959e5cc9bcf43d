//! What the command's test suites share.

use std::path::PathBuf;

/// The target directory this build uses (`CARGO_TARGET_DIR`, relative or
/// not, or the workspace's `target/`): the one the binary under test is in.
pub fn target_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_shallot"));
    exe.ancestors()
        .nth(2)
        .expect("<target>/<profile>/shallot")
        .into()
}
