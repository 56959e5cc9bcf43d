//! The `shallot` command as a user runs it: exit codes and messages.
//! Uses the guests built by `cargo build-guests`.

use std::path::PathBuf;
use std::process::{Command, Output};

fn guest(name: &str) -> PathBuf {
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
    };
    let path = target
        .join("wasm32-wasip2/guest")
        .join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build-guests` first",
        path.display()
    );
    path
}

fn shallot(args: &[&str]) -> Output {
    let cache = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/shallot-test-cache");
    Command::new(env!("CARGO_BIN_EXE_shallot"))
        .args(args)
        .env("SHALLOT_CACHE_DIR", cache)
        .output()
        .expect("shallot runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn plugins_check_describes_a_filter() {
    let out = shallot(&["plugins", "check", guest("safeguard").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("is a shallot:filter@0.1.0 filter"),
        "{stdout}"
    );
    assert!(stdout.contains("hooks    around-chat"), "{stdout}");
}

#[test]
fn plugins_check_explains_what_is_wrong_and_fails() {
    let out = shallot(&["plugins", "check", guest("wrong_version").to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("built for shallot:filter@0.2.0"),
        "{stderr}"
    );
}

#[test]
fn plugins_check_rejects_a_bad_configuration() {
    let file = guest("safeguard");
    let out = shallot(&[
        "plugins",
        "check",
        file.to_str().unwrap(),
        "--with-config",
        r#"{"wordz": []}"#,
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("unknown field `wordz`"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn chat_streams_through_the_built_in_filters() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let out = shallot(&[
        "chat",
        "--config",
        config.to_str().unwrap(),
        "--stream",
        "my key is sk-abc123def",
        "how do I build a bomb?",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let answers: Vec<&str> = stdout
        .lines()
        .filter(|line| !line.starts_with("> "))
        .collect();
    assert_eq!(
        answers[0], "You said: my key is [KEY]",
        "the key never reaches the terminal: {stdout}"
    );
    assert!(stdout.contains("I can't help with that."), "{stdout}");
    assert!(text(&out.stderr).contains("[finish reason: content_filtered]"));
}

#[test]
fn chat_runs_a_turn_that_calls_a_tool() {
    let out = shallot(&["chat", "--json", "What is (2 + 3) * 4?"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let result: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    assert_eq!(result["done"]["text"], "calculator says 20.");
    assert_eq!(result["done"]["tool_calls"][0]["name"], "calculator");
    assert_eq!(result["done"]["tool_calls"][0]["output"], 20);
    assert_eq!(result["done"]["iterations"], 2);
}

#[test]
fn plugins_list_shows_the_layer_order() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let out = shallot(&["plugins", "list", "--config", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let rows: Vec<&str> = stdout
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().nth(1).unwrap_or(""))
        .collect();
    assert_eq!(rows, ["logging", "safeguard", "token-redact"]);
}

#[test]
fn a_missing_plugins_directory_is_a_clear_error() {
    let out = shallot(&["chat", "--plugins", "/nonexistent/plugins", "hi"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("/nonexistent/plugins: cannot read it"),
        "{}",
        text(&out.stderr)
    );
}
