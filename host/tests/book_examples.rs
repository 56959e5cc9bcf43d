//! The book's filter examples (docs/book/writing-filters-*.md), verbatim:
//! each chapter's code blocks are written to disk as it says, and its
//! shell block is run line by
//! line with the `shallot` under test on the PATH. The install lines
//! (`pip install`, `npm install`) are left out: tests reach no network, and
//! the tools they install are the ones `scripts/build-polyglot` installed
//! at the same pinned versions.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::target_dir;

/// The checkout's root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// The code blocks of the section under `heading` in the book's chapter
/// `chapter`, in order, as (language, text).
fn blocks(chapter: &str, heading: &str) -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(root().join("docs/book").join(chapter)).unwrap();
    let start = readme
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("the book's {chapter} has a section '{heading}'"));
    let section = &readme[start + 1..];
    let section = &section[..section[3..]
        .find("\n## ")
        .map_or(section.len(), |end| end + 3)];
    let mut found = Vec::new();
    let mut lines = section.lines();
    while let Some(line) = lines.next() {
        if let Some(language) = line.strip_prefix("```") {
            let text: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
            found.push((language.to_owned(), text.join("\n") + "\n"));
        }
    }
    found
}

fn block(blocks: &[(String, String)], language: &str) -> String {
    blocks
        .iter()
        .find(|(lang, _)| lang == language)
        .unwrap_or_else(|| panic!("a ```{language} block"))
        .1
        .clone()
}

/// A fresh scratch directory for one example.
fn scratch(name: &str) -> PathBuf {
    let dir = target_dir().join("readme-examples").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the section's shell lines in `dir`, skipping the install lines,
/// with `path` first on the PATH; returns what the last one printed.
fn run_shell(sh: &str, dir: &Path, path: &[PathBuf]) -> String {
    // One example at a time: each compiles a component of up to 18 MiB,
    // and `plugins check` instantiating a Python one while two other
    // compiles hold both cores of a small machine can pass the default
    // 100 ms CPU budget (the meter counts a guest's running time).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut search = path.to_vec();
    search.push(
        PathBuf::from(env!("CARGO_BIN_EXE_shallot"))
            .parent()
            .unwrap()
            .into(),
    );
    search.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let search = std::env::join_paths(search).unwrap();
    let mut last = String::new();
    for line in sh.lines().filter(|l| !l.trim().is_empty()) {
        if line.starts_with("pip install") || line.starts_with("npm install") {
            continue;
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(line)
            .current_dir(dir)
            .env("PATH", &search)
            .env_remove("CARGO_TARGET_DIR")
            .env("SHALLOT_CACHE_DIR", target_dir().join("shallot-test-cache"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "`{line}` failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        last = String::from_utf8_lossy(&out.stdout).into_owned();
    }
    last
}

fn link(from: &Path, to: &Path) {
    std::os::unix::fs::symlink(from, to).unwrap();
}

#[test]
fn the_rust_filter_builds_and_checks_as_written() {
    let blocks = blocks("writing-filters-rust.md", "Writing a filter in Rust");
    // Beside the checkout, in a directory named `shallot`, as the book
    // says. Kept between runs, so its build is incremental.
    let home = target_dir().join("readme-examples/rust");
    let krate = home.join("guard");
    std::fs::create_dir_all(krate.join("src")).unwrap();
    let _ = std::fs::remove_file(home.join("shallot"));
    link(&root(), &home.join("shallot"));
    // Its own workspace: it does not belong to the one it sits under.
    let manifest = block(&blocks, "toml") + "\n[workspace]\n";
    std::fs::write(krate.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(krate.join("src/lib.rs"), block(&blocks, "rust")).unwrap();
    let shown = run_shell(&block(&blocks, "sh"), &krate, &[]);
    assert!(shown.contains("name     guard"), "{shown}");
    assert!(shown.contains("hooks    around-chat"), "{shown}");
}

#[test]
fn the_python_filter_builds_and_checks_as_written() {
    let blocks = blocks("writing-filters-python.md", "Writing a filter in Python");
    let dir = scratch("python");
    link(&root().join("wit"), &dir.join("wit"));
    link(&root().join("sdk"), &dir.join("sdk"));
    std::fs::create_dir_all(dir.join("my_filter")).unwrap();
    std::fs::write(dir.join("my_filter/app.py"), block(&blocks, "python")).unwrap();
    let venv = target_dir().join("polyglot/venv/bin");
    let shown = run_shell(&block(&blocks, "sh"), &dir, &[venv]);
    assert!(shown.contains("name     guard"), "{shown}");
    assert!(shown.contains("around-chat, token-transform"), "{shown}");
}

#[test]
fn the_javascript_filter_builds_and_checks_as_written() {
    let blocks = blocks(
        "writing-filters-javascript.md",
        "Writing a filter in JavaScript",
    );
    let dir = scratch("javascript");
    link(&root().join("wit"), &dir.join("wit"));
    link(
        &root().join("sdk/js/node_modules"),
        &dir.join("node_modules"),
    );
    std::fs::copy(root().join("sdk/js/shallot.js"), dir.join("shallot.js")).unwrap();
    std::fs::write(dir.join("app.js"), block(&blocks, "js")).unwrap();
    let shown = run_shell(&block(&blocks, "sh"), &dir, &[]);
    assert!(shown.contains("name     guard"), "{shown}");
    assert!(shown.contains("around-chat, token-transform"), "{shown}");
}
