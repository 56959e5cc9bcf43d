//! The `shallot` command as a user runs it: exit codes and messages.
//! Uses the guests built by `cargo build-guests`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::thread::JoinHandle;

mod common;
use common::target_dir;
#[path = "../../tests/support/redis.rs"]
mod redis;

fn guest(name: &str) -> PathBuf {
    let path = target_dir()
        .join("wasm32-wasip2/guest")
        .join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build-guests` (and `scripts/build-polyglot`) first",
        path.display()
    );
    path
}

fn shallot(args: &[&str]) -> Output {
    let cache = target_dir().join("shallot-test-cache");
    Command::new(env!("CARGO_BIN_EXE_shallot"))
        .args(args)
        .env("SHALLOT_CACHE_DIR", cache)
        .env("CARGO_TARGET_DIR", target_dir())
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("SHALLOT_MODEL")
        .output()
        .expect("shallot runs")
}

/// Runs `shallot` with `input` on its stdin (a pipe, not a terminal).
fn shallot_with_input(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shallot"))
        .args(args)
        .env("SHALLOT_CACHE_DIR", target_dir().join("shallot-test-cache"))
        .env("CARGO_TARGET_DIR", target_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("shallot runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
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
        stdout.contains("is a shallot:filter@0.1.5 filter"),
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
    assert!(text(&out.stderr).contains("[finish reason: content-filtered]"));
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
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().nth(1).unwrap_or(""))
        .collect();
    assert_eq!(rows, ["logging", "safeguard", "token-redact"]);
    for chain in [
        "chat           logging -> safeguard -> model",
        "tool           logging -> tools",
        "turn           logging -> tool loop",
        "token          model -> token-redact -> caller",
    ] {
        assert!(stdout.contains(chain), "{stdout}");
    }
}

#[test]
fn a_redaction_filter_holds_in_every_output_mode() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let config = config.to_str().unwrap();
    for mode in [&[][..], &["--stream"], &["--json"], &["--stream", "--json"]] {
        let mut args = vec!["chat", "--config", config];
        args.extend_from_slice(mode);
        args.push("My deploy key is sk-live4f9a2b7c, keep it safe");
        let out = shallot(&args);
        assert!(out.status.success(), "{mode:?}: {}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert!(!stdout.contains("sk-live4f9a2b7c"), "{mode:?}: {stdout}");
        assert!(stdout.contains("[KEY]"), "{mode:?}: {stdout}");
    }
}

#[test]
fn a_failed_turn_fails_the_command_with_json_too() {
    let out = shallot(&["chat", "--json", "--max-iterations", "0", "hi"]);
    assert!(!out.status.success());
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["error"]["kind"], "limit-exceeded");
}

#[test]
fn filters_never_go_missing_silently() {
    let dir = std::env::temp_dir().join(format!("shallot-cli-{}", std::process::id()));
    let (empty, orphan) = (dir.join("empty"), dir.join("orphan"));
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::create_dir_all(&orphan).unwrap();
    std::fs::write(orphan.join("20-guard.json"), "{}").unwrap();

    let out = shallot(&["chat", "--plugins", empty.to_str().unwrap(), "hi"]);
    assert!(out.status.success());
    assert!(
        text(&out.stderr).contains("warning: no filters to load"),
        "{}",
        text(&out.stderr)
    );

    let out = shallot(&["chat", "--plugins", orphan.to_str().unwrap(), "hi"]);
    assert!(!out.status.success(), "a configuration without its plugin");
    assert!(
        text(&out.stderr).contains("20-guard.json: configures a plugin that is not here"),
        "{}",
        text(&out.stderr)
    );

    let out = shallot(&["chat", "hi"]);
    assert!(out.status.success());
    assert!(
        text(&out.stderr).contains("the prompts go to the model unfiltered"),
        "{}",
        text(&out.stderr)
    );

    let probe = guest("probe");
    let out = shallot(&[
        "plugins",
        "check",
        probe.to_str().unwrap(),
        "--with-config",
        r#"{"hooks": []}"#,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("none (passes everything through)"));
}

#[test]
fn more_instance_slots_than_the_address_space_holds_is_a_clear_error() {
    let out = shallot(&[
        "--instance-slots",
        "1000000",
        "plugins",
        "list",
        "--plugins",
        "plugins",
    ]);
    assert!(!out.status.success());
    let said = text(&out.stderr);
    assert!(said.contains("1000000 instance slots"), "{said}");
    assert!(said.contains("try fewer --instance-slots"), "{said}");

    let out = shallot(&[
        "--instance-slots",
        "0",
        "plugins",
        "list",
        "--plugins",
        "plugins",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--instance-slots"),
        "{}",
        text(&out.stderr)
    );
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

/// A one-request chat-completions server on loopback: answers with `status`
/// and `body`, and hands back the request's head and body.
fn model_server(status: u16, body: &str) -> (String, JoinHandle<(String, serde_json::Value)>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let body = body.to_owned();
    let served = std::thread::spawn(move || {
        let (socket, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(socket);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            head.push_str(&line.to_ascii_lowercase());
        }
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0);
        let mut request = vec![0; length];
        reader.read_exact(&mut request).unwrap();
        let answer = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        reader.get_mut().write_all(answer.as_bytes()).unwrap();
        (head, serde_json::from_slice(&request).unwrap())
    });
    (url, served)
}

#[test]
fn chat_talks_to_an_openai_compatible_server() {
    let answer = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"Hi from the server."},"finish_reason":"stop"}]}"#;
    let (url, served) = model_server(200, answer);
    let out = Command::new(env!("CARGO_BIN_EXE_shallot"))
        .args([
            "chat",
            "--model-url",
            &url,
            "--model",
            "tiny",
            "--no-tools",
            "--system",
            "Be brief.",
            "hello",
        ])
        .env("OPENAI_API_KEY", "sk-from-env")
        .env_remove("OPENAI_BASE_URL")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "Hi from the server.\n");
    let (head, body) = served.join().unwrap();
    assert!(head.starts_with("post /v1/chat/completions"), "{head}");
    assert!(head.contains("authorization: bearer sk-from-env"), "{head}");
    assert_eq!(body["model"], "tiny");
    assert_eq!(
        body["messages"],
        serde_json::json!([{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "hello" }])
    );
    assert!(body.get("tools").is_none(), "--no-tools offers none");
}

#[test]
fn chat_talks_to_an_anthropic_server_its_model_table_names() {
    let answer = r#"{"type":"message","role":"assistant","model":"claude-x","content":[{"type":"text","text":"Hi from Anthropic."}],"stop_reason":"end_turn","usage":{"input_tokens":5,"output_tokens":4}}"#;
    let (url, served) = model_server(200, answer);
    let dir = std::env::temp_dir().join(format!("shallot-cli-anthropic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("shallot.toml");
    std::fs::write(
        &config,
        "[model]\napi = \"anthropic\"\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"claude-x\"\nmax_tokens = 77\n",
    )
    .unwrap();
    // --model-url moves the table's server, keeping its API; the key
    // comes from ANTHROPIC_API_KEY, never OpenAI's.
    let out = Command::new(env!("CARGO_BIN_EXE_shallot"))
        .args(["chat", "--config"])
        .arg(&config)
        .args([
            "--model-url",
            &url,
            "--no-tools",
            "--system",
            "Be brief.",
            "hello",
        ])
        .env("ANTHROPIC_API_KEY", "sk-ant-from-env")
        .env("OPENAI_API_KEY", "sk-openai-not-this")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "Hi from Anthropic.\n");
    let (head, body) = served.join().unwrap();
    assert!(head.starts_with("post /v1/messages"), "{head}");
    assert!(head.contains("x-api-key: sk-ant-from-env"), "{head}");
    assert!(head.contains("anthropic-version: 2023-06-01"), "{head}");
    assert!(!head.contains("sk-openai-not-this"), "{head}");
    assert_eq!(body["model"], "claude-x");
    assert_eq!(body["max_tokens"], 77);
    assert_eq!(body["system"], "Be brief.");
    assert_eq!(
        body["messages"],
        serde_json::json!([{ "role": "user", "content": [{ "type": "text", "text": "hello" }] }])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_refusing_model_server_is_a_clear_error() {
    let (url, served) = model_server(401, r#"{"error":{"message":"Incorrect API key"}}"#);
    let out = shallot(&["chat", "--model-url", &url, "hello"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("answered 401: Incorrect API key"),
        "{stderr}"
    );
    served.join().unwrap();
}

#[test]
fn a_model_without_a_server_is_refused() {
    let out = shallot(&["chat", "--model", "gpt-4o", "hello"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--model-url"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_bad_model_table_in_the_config_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("shallot-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("shallot.toml");
    std::fs::write(
        &config,
        "[model]\nbase_url = \"http://127.0.0.1:1/v1\"\nmodle = \"x\"\n",
    )
    .unwrap();
    let out = shallot(&["chat", "--config", config.to_str().unwrap(), "hello"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("unknown field `modle`"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_runs_the_python_and_javascript_examples() {
    guest("pii_guard_py");
    guest("word_mask_js");
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/shallot.toml");
    let out = shallot(&[
        "chat",
        "--config",
        config.to_str().unwrap(),
        "--stream",
        "--no-tools",
        "Write to jane.doe@example.com, darn it",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "You said: Write to [EMAIL], **** it\n");
}

#[test]
fn a_rejected_configuration_says_where_it_came_from() {
    let dir = std::env::temp_dir().join(format!("shallot-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let guests = guest("safeguard");
    let guests = guests.parent().unwrap().to_str().unwrap();
    let toml = dir.join("shallot.toml");
    std::fs::write(
        &toml,
        format!(
            "plugin_dir = \"{guests}\"\n\n[[filter]]\nplugin = \"logging.wasm\"\n\n[[filter]]\nname = \"guard\"\nplugin = \"safeguard.wasm\"\nconfig = {{ wrods = [\"x\"] }}\n"
        ),
    )
    .unwrap();
    let out = shallot(&["chat", "--config", toml.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("filter 'guard'"), "{stderr}");
    assert!(stderr.contains("unknown field `wrods`"), "{stderr}");
    assert!(
        stderr.contains("shallot.toml, the [[filter]] at line 6"),
        "{stderr}"
    );
    assert_eq!(stderr.matches("os error").count(), 0, "{stderr}");

    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(guest("safeguard"), plugins.join("20-guard.wasm")).unwrap();
    std::fs::write(plugins.join("20-guard.json"), r#"{"wrods": 1}"#).unwrap();
    let out = shallot(&["chat", "--plugins", plugins.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("configured in "), "{stderr}");
    assert!(stderr.contains("20-guard.json"), "{stderr}");
}

#[test]
fn a_missing_guest_says_once_what_is_wrong_and_how_to_build_it() {
    let dir = std::env::temp_dir().join(format!("shallot-cli-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("shallot.toml");
    std::fs::write(
        &toml,
        "plugin_dir = \"nowhere/wasm32-wasip2/guest\"\n[[filter]]\nplugin = \"logging.wasm\"\n",
    )
    .unwrap();
    let out = shallot(&["chat", "--config", toml.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("cargo build-guests"), "{stderr}");
}

#[test]
fn chat_without_prompts_reads_them_from_stdin_as_one_conversation() {
    let out = shallot_with_input(&["chat", "--json"], "What is (2 + 3) * 4?\n\nthanks\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let turns: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(turns.len(), 2, "one turn per non-blank line");
    assert_eq!(turns[0]["done"]["text"], "calculator says 20.");
    let history = turns[1]["done"]["messages"].as_array().unwrap();
    assert!(
        history
            .iter()
            .any(|m| m["content"] == "What is (2 + 3) * 4?"),
        "the second turn sees the first: {history:?}"
    );
}

/// One HTTP/1.1 request to `address`; the status line and the body.
fn http(address: &str, method: &str, path: &str, body: &str) -> (String, String) {
    let (status, _, body) = exchange(address, method, path, body);
    (status, body)
}

/// One request: the response's status line, headers (lower-cased names)
/// and body.
fn exchange(
    address: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (String, std::collections::HashMap<String, String>, String) {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_owned();
    let headers = lines
        .filter_map(|line| line.split_once(": "))
        .map(|(name, value)| (name.to_ascii_lowercase(), value.to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

/// Everything a gateway said on stderr so far, and a signal for each line.
#[derive(Default)]
struct Said {
    text: std::sync::Mutex<String>,
    line: std::sync::Condvar,
}

/// A served gateway: the child, and everything it says on stderr (drained
/// as it comes, so the pipe never fills).
struct Gateway {
    child: std::process::Child,
    said: std::sync::Arc<Said>,
    reader: Option<JoinHandle<()>>,
    address: String,
}

impl Gateway {
    /// `shallot serve --config <config>` on a free port.
    fn start(config: &std::path::Path) -> Self {
        Self::start_with(config, &[])
    }

    /// The same, with more arguments.
    fn start_with(config: &std::path::Path, more: &[&str]) -> Self {
        Self::start_in(config, more, &[])
    }

    /// The same, with more environment variables.
    fn start_in(config: &std::path::Path, more: &[&str], env: &[(&str, &str)]) -> Self {
        Self::launch(config, more, env, |_| {}, |_, _| {})
    }

    /// The same, calling `spawned` with the process id as soon as it runs,
    /// and `heard` with it and each line it says, as it says it.
    fn launch(
        config: &std::path::Path,
        more: &[&str],
        env: &[(&str, &str)],
        spawned: impl FnOnce(u32),
        mut heard: impl FnMut(u32, &str) + Send + 'static,
    ) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shallot"))
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .args(more)
            .envs(env.iter().copied())
            .env("SHALLOT_CACHE_DIR", target_dir().join("shallot-test-cache"))
            .env("CARGO_TARGET_DIR", target_dir())
            .env_remove("OPENAI_BASE_URL")
            .env_remove("OPENAI_API_KEY")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("shallot runs");
        let pid = child.id();
        spawned(pid);
        let said = std::sync::Arc::new(Said::default());
        let (found, address) = std::sync::mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let reader = {
            let said = said.clone();
            std::thread::spawn(move || {
                for line in stderr.lines().map_while(Result::ok) {
                    heard(pid, &line);
                    {
                        let mut text = said.text.lock().unwrap();
                        text.push_str(&line);
                        text.push('\n');
                    }
                    said.line.notify_all();
                    if let Some(rest) = line.strip_prefix("shallot serve: http://") {
                        let _ = found.send(rest.split_once("/v1").unwrap().0.to_owned());
                    }
                }
            })
        };
        let address = address
            .recv_timeout(std::time::Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no address: {}", said.text.lock().unwrap()));
        Gateway {
            child,
            said,
            reader: Some(reader),
            address,
        }
    }

    fn said(&self) -> String {
        self.said.text.lock().unwrap().clone()
    }

    /// Waits until it has said `count` lines starting with `prefix`, and
    /// returns them; fails the test after a minute.
    fn lines(&self, prefix: &str, count: usize) -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut text = self.said.text.lock().unwrap();
        loop {
            let found: Vec<String> = text
                .lines()
                .filter(|line| line.starts_with(prefix))
                .map(str::to_owned)
                .collect();
            if found.len() >= count {
                return found;
            }
            let left = deadline
                .checked_duration_since(std::time::Instant::now())
                .unwrap_or_else(|| panic!("never said '{prefix}' {count} times: {text}"));
            text = self.said.line.wait_timeout(text, left).unwrap().0;
        }
    }

    /// Sends it SIGHUP.
    fn hang_up(&self) {
        // SAFETY: signals the child this test started and still owns.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as i32, libc::SIGHUP) },
            0
        );
    }

    /// Stops it with SIGTERM; everything it said.
    fn terminate(mut self) -> String {
        // SAFETY: signals the child this test started and still owns.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) },
            0
        );
        let status = self.child.wait().unwrap();
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
        let said = self.said();
        assert!(status.success(), "{status}: {said}");
        said
    }
}

impl Drop for Gateway {
    /// A failed test does not leave its gateway running.
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

/// A SIGHUP while the first plugin set still compiles (seconds, for a
/// large plugin and an empty cache) neither ends the process, as SIGHUP's
/// default action would, nor is lost: the set reloads once after start.
#[test]
fn a_sighup_while_the_first_set_compiles_reloads_it_after_start() {
    let dir = std::env::temp_dir().join(format!("shallot-early-hup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("shallot.toml");
    let plugin = guest("schema_validation");
    std::fs::write(
        &config,
        format!(
            "[[filter]]\nplugin = {:?}\nconfig = {{ schema = {{ type = \"object\" }} }}\n",
            plugin.display().to_string()
        ),
    )
    .unwrap();
    // Outside the config's directory: a directory made beside the config
    // is a change that reloads too.
    let cache = dir.with_extension("cache");
    let _ = std::fs::remove_dir_all(&cache);
    let cache = cache.to_str().unwrap();
    let hang_up_while_compiling = |pid: u32, line: &str| {
        if line.starts_with("compiling ") {
            // SAFETY: signals the child this test started and still owns.
            unsafe { libc::kill(pid as i32, libc::SIGHUP) };
        }
    };
    let gateway = Gateway::launch(
        &config,
        &["--cache-dir", cache],
        &[],
        |_| {},
        hang_up_while_compiling,
    );
    let (status, _) = http(&gateway.address, "GET", "/healthz", "");
    assert!(status.contains("200"), "{status}");
    let reloaded = gateway.lines("shallot serve: reloaded", 1);
    assert_eq!(asked(&reloaded[0]), "SIGHUP", "{reloaded:?}");
    let said = gateway.terminate();
    assert!(said.contains("compiling "), "{said}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(cache).unwrap();
}

/// The soft open-file limit of process `pid`, and its hard limit.
fn open_files(pid: i32) -> (u64, u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads a limit of a process this test owns into `limit`.
    let read = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut limit) };
    assert_eq!(read, 0);
    (limit.rlim_cur, limit.rlim_max)
}

/// A gateway started under a low soft open-file limit (a common default:
/// 1,024) raises it to the hard limit, so it can hold as many connections
/// as the system lets it.
#[test]
fn serve_raises_its_open_file_limit_to_the_hard_limit() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let lower_the_limit = |pid: u32| {
        let (_, hard) = open_files(pid as i32);
        let low = libc::rlimit {
            rlim_cur: hard.min(1024) / 2,
            rlim_max: hard,
        };
        // SAFETY: lowers a limit of the child this test just started.
        let set =
            unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &low, std::ptr::null_mut()) };
        assert_eq!(set, 0);
    };
    let gateway = Gateway::launch(&config, &[], &[], lower_the_limit, |_, _| {});
    let (soft, hard) = open_files(gateway.child.id() as i32);
    assert_eq!(soft, hard, "{}", gateway.said());
    gateway.terminate();
}

#[test]
fn serve_is_an_openai_gateway_over_the_demo_filters_and_stops_on_sigterm() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let gateway = Gateway::start_with(&config, &["-v", "--log-format", "json"]);
    let address = gateway.address.clone();
    assert!(
        gateway.said().contains("model 'shallot-echo'"),
        "{}",
        gateway.said()
    );
    let (status, models) = http(&address, "GET", "/v1/models", "");
    assert!(status.contains("200"), "{status}");
    assert!(models.contains("shallot-echo"), "{models}");
    let ask = r#"{"model":"shallot-echo","messages":[{"role":"user","content":"My deploy key is sk-live4f9a2b7c"}]}"#;
    let (status, answer) = http(&address, "POST", "/v1/chat/completions", ask);
    assert!(status.contains("200"), "{status}: {answer}");
    assert!(answer.contains("chat.completion"), "{answer}");
    assert!(
        !answer.contains("sk-live4f9a2b7c"),
        "token-redact holds: {answer}"
    );

    let rest = gateway.terminate();
    assert!(rest.contains("stopped"), "{rest}");
    let answered = rest
        .lines()
        .filter(|line| line.starts_with('{'))
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .find(|line| line["fields"]["message"] == "answered")
        .unwrap_or_else(|| panic!("a JSON log line per request: {rest}"));
    assert_eq!(answered["fields"]["status"], 200);
    assert_eq!(answered["span"]["model"], "shallot-echo");
    assert!(
        answered["span"]["id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-")
    );
}

/// A stand-in OpenTelemetry collector on loopback: every OTLP/HTTP export
/// posted to it, as (path, content type, JSON body).
#[cfg(feature = "otel")]
fn collector() -> (
    String,
    std::sync::mpsc::Receiver<(String, String, serde_json::Value)>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (sender, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let sender = sender.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                loop {
                    let mut request = String::new();
                    if reader.read_line(&mut request).unwrap_or(0) == 0 {
                        return;
                    }
                    let (mut length, mut kind) = (0, String::new());
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let Some((name, value)) = line.trim_end().split_once(':') else {
                            break;
                        };
                        match name.to_ascii_lowercase().as_str() {
                            "content-length" => length = value.trim().parse().unwrap(),
                            "content-type" => kind = value.trim().to_owned(),
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
                    let path = request
                        .split_whitespace()
                        .nth(1)
                        .unwrap_or_default()
                        .to_owned();
                    let body = serde_json::from_slice(&body).unwrap_or_default();
                    let _ = sender.send((path, kind, body));
                }
            });
        }
    });
    (base, received)
}

#[cfg(feature = "otel")]
#[test]
fn serve_exports_a_span_per_request_and_per_filter_call_to_an_otlp_collector() {
    let (endpoint, exports) = collector();
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/shallot.toml");
    let gateway = Gateway::start_in(
        &config,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            // Longer than the test: only the flush at exit sends them.
            ("OTEL_BSP_SCHEDULE_DELAY", "600000"),
        ],
    );
    let ask = r#"{"model":"shallot-echo","messages":[{"role":"user","content":"hello"}]}"#;
    let (status, answer) = http(&gateway.address, "POST", "/v1/chat/completions", ask);
    assert!(status.contains("200"), "{status}: {answer}");
    let said = gateway.terminate();

    // Everything exported by the time it stopped (the last batch is flushed
    // on the way out).
    let mut spans = Vec::new();
    while let Ok((path, kind, body)) = exports.recv_timeout(std::time::Duration::from_secs(60)) {
        assert_eq!(path, "/v1/traces");
        assert_eq!(kind, "application/json");
        for resource in body["resourceSpans"].as_array().unwrap() {
            let service = resource["resource"]["attributes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["key"] == "service.name")
                .map(|a| a["value"]["stringValue"].clone());
            assert_eq!(service, Some(serde_json::json!("shallot")));
            for scope in resource["scopeSpans"].as_array().unwrap() {
                spans.extend(scope["spans"].as_array().unwrap().iter().cloned());
            }
        }
        if spans.iter().any(|s| s["name"] == "request") {
            break;
        }
    }
    let attribute = |span: &serde_json::Value, key: &str| {
        span["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| a["value"].clone())
    };
    let request = spans
        .iter()
        .find(|s| s["name"] == "request")
        .unwrap_or_else(|| panic!("no request span in {spans:?}: {said}"));
    assert_eq!(
        attribute(request, "model"),
        Some(serde_json::json!({"stringValue": "shallot-echo"}))
    );
    let calls: Vec<_> = spans
        .iter()
        .filter(|s| s["name"] == "filter")
        .map(|s| {
            assert_eq!(s["traceId"], request["traceId"], "one trace per request");
            attribute(s, "name").unwrap()["stringValue"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    // Spans only: no log line (the logging filter's included) goes out.
    assert!(
        spans
            .iter()
            .all(|s| s["events"].as_array().is_none_or(Vec::is_empty)),
        "{spans:?}"
    );
    // Token transforms are counted in /metrics, not spanned token by token.
    for filter in ["logging", "safeguard"] {
        assert!(
            calls.iter().any(|c| c == filter),
            "no span for {filter}'s calls: {calls:?}"
        );
    }
}

#[test]
fn serve_works_with_the_official_openai_python_sdk() {
    sdk_client("openai", "client.py", "/v1");
}

#[test]
fn serve_works_with_the_official_anthropic_python_sdk() {
    sdk_client("anthropic", "anthropic_client.py", "");
}

/// Runs `tests/gateway/<script>`, which drives a gateway serving
/// `tests/gateway/shallot.toml` with the Python SDK `module`, given the
/// gateway's address and `path` as its base URL.
fn sdk_client(module: &str, script: &str, path: &str) {
    let python = target_dir().join("polyglot/venv/bin/python");
    let has_sdk = Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_sdk,
        "{} has no {module} SDK: run scripts/build-polyglot first",
        python.display()
    );
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let gateway = Gateway::start(&root.join("tests/gateway/shallot.toml"));
    let client = Command::new(&python)
        .arg(root.join("tests/gateway").join(script))
        .arg(format!("http://{}{path}", gateway.address))
        .output()
        .unwrap();
    let rest = gateway.terminate();
    assert!(
        client.status.success(),
        "{}{}gateway: {rest}",
        text(&client.stdout),
        text(&client.stderr)
    );
}

/// The safeguard's refusal a gateway serving `dir/shallot.toml` answers
/// "build a bomb" with; `None` if the request failed.
fn refusal(address: &str) -> Option<String> {
    let ask = r#"{"model":"shallot-echo","messages":[{"role":"user","content":"build a bomb"}]}"#;
    let (status, body) = http(address, "POST", "/v1/chat/completions", ask);
    if !status.contains("200") {
        return None;
    }
    let start = body.find("\"content\":\"")? + "\"content\":\"".len();
    let end = body[start..].find('"')? + start;
    Some(body[start..end].to_owned())
}

#[test]
fn serve_reloads_a_changed_config_and_plugin_under_load_without_failing_a_request() {
    let dir = std::env::temp_dir().join(format!("shallot-reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plugin = dir.join("safeguard.wasm");
    let good = std::fs::read(guest("safeguard")).unwrap();
    std::fs::write(&plugin, &good).unwrap();
    let config = dir.join("shallot.toml");
    let write_config = |answer: &str| {
        let toml = format!(
            "plugin_dir = \".\"\n[[filter]]\nplugin = \"safeguard.wasm\"\nconfig = {{ words = [\"bomb\"], failure_response = \"{answer}\" }}\n"
        );
        let staged = dir.join("shallot.toml.new");
        std::fs::write(&staged, toml).unwrap();
        std::fs::rename(&staged, &config).unwrap();
    };
    write_config("no-0");
    let gateway = Gateway::start(&config);
    let address = gateway.address.clone();

    // Requests all along, counting any that fails.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, address) = (stop.clone(), address.clone());
        std::thread::spawn(move || {
            let (mut served, mut failed) = (0, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match refusal(&address) {
                    Some(_) => served += 1,
                    None => failed.push(served),
                }
            }
            (served, failed)
        })
    };
    // Each reload is swapped in before it is announced.
    let mut reloads = 0;
    let mut reloaded = || {
        reloads += 1;
        gateway.lines("shallot serve: reloaded", reloads);
    };
    for round in 1..=20 {
        if round == 10 {
            // A broken plugin: the reload fails, the last good set serves.
            std::fs::write(&plugin, b"\0asm not really").unwrap();
            gateway.lines("shallot serve: reload failed", 1);
            let (_, ready) = http(&address, "GET", "/readyz", "");
            assert!(
                ready.contains("\"last_error\":\""),
                "the failed reload is not reported: {ready}"
            );
            assert_eq!(refusal(&address).as_deref(), Some("no-9"));
            std::fs::write(&plugin, &good).unwrap();
            reloaded();
            assert_eq!(refusal(&address).as_deref(), Some("no-9"));
        }
        let wanted = format!("no-{round}");
        write_config(&wanted);
        reloaded();
        assert_eq!(refusal(&address), Some(wanted));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (served, failed) = load.join().unwrap();
    let said = gateway.terminate();
    assert!(
        failed.is_empty(),
        "requests failed after {failed:?} of {served}: {said}"
    );
    assert!(served > 20, "{served} requests");
    assert!(said.contains("reload failed"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_name_made_beside_the_config_cannot_forge_a_reload_line() {
    let dir = std::env::temp_dir().join(format!("shallot-forge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("shallot.toml");
    std::fs::write(&config, "").unwrap();
    let gateway = Gateway::start(&config);

    // Whoever can write beside the config names a directory that, printed
    // raw, would end the line and start a forged one.
    let forged = "x\nshallot serve: reloaded (forged); asked by nobody\u{1b}[2K";
    std::fs::create_dir(dir.join(forged)).unwrap();
    let reloaded = gateway.lines("shallot serve: reloaded", 1);
    let asked = asked(&reloaded[0]);
    assert!(
        asked.ends_with("x\\nshallot serve: reloaded (forged); asked by nobody\\u{1b}[2K"),
        "{reloaded:?}"
    );
    let said = gateway.said();
    let lines = said
        .lines()
        .filter(|line| line.starts_with("shallot serve: reloaded"));
    assert_eq!(lines.count(), 1, "{said}");
    assert!(!said.contains('\u{1b}'), "{said:?}");
    gateway.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

/// What asked for the reload a `reloaded` line reports.
fn asked(line: &str) -> &str {
    line.split_once("; asked by ")
        .map_or("", |(_, asked)| asked)
}

/// The swaps `/readyz` reports.
fn swapped(address: &str) -> u64 {
    let (_, ready) = http(address, "GET", "/readyz", "");
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    ready["reloads"]["swapped"].as_u64().unwrap()
}

/// A reload that moves the plugins to another directory watches that one
/// from then on: a plugin replaced there reloads the set.
#[test]
fn serve_watches_the_plugin_directory_a_reload_moves_to() {
    let dir = std::env::temp_dir().join(format!("shallot-rewatch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["p1", "p2"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        std::fs::copy(guest("safeguard"), dir.join(sub).join("safeguard.wasm")).unwrap();
    }
    let config = dir.join("shallot.toml");
    let write_config = |plugins: &str, answer: &str| {
        let toml = format!(
            "plugin_dir = \"{plugins}\"\n[[filter]]\nplugin = \"safeguard.wasm\"\nconfig = {{ words = [\"bomb\"], failure_response = \"{answer}\" }}\n"
        );
        let staged = dir.join("shallot.toml.new");
        std::fs::write(&staged, toml).unwrap();
        std::fs::rename(&staged, &config).unwrap();
    };
    write_config("p1", "no-1");
    let gateway = Gateway::start(&config);
    assert_eq!(refusal(&gateway.address).as_deref(), Some("no-1"));
    write_config("p2", "no-2");
    gateway.lines("shallot serve: reloaded", 1);
    assert_eq!(refusal(&gateway.address).as_deref(), Some("no-2"));
    let staged = dir.join("p2").join("passthrough.tmp");
    std::fs::copy(guest("passthrough"), &staged).unwrap();
    std::fs::rename(&staged, dir.join("p2").join("safeguard.wasm")).unwrap();
    gateway.lines("shallot serve: reloaded", 2);
    let answer = refusal(&gateway.address);
    assert!(
        answer.as_ref().is_some_and(|a| a.contains("bomb")),
        "{answer:?}"
    );
    gateway.terminate();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_reloads_for_its_config_and_plugins_not_for_other_files_beside_them() {
    let dir = std::env::temp_dir().join(format!("shallot-beside-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(guest("safeguard"), dir.join("safeguard.wasm")).unwrap();
    let config = dir.join("shallot.toml");
    let toml = "plugin_dir = \".\"\n[[filter]]\nplugin = \"safeguard.wasm\"\nconfig = { words = [\"bomb\"] }\n";
    std::fs::write(&config, toml).unwrap();
    let gateway = Gateway::start(&config);
    let address = gateway.address.clone();

    // A log, a trace and a store written beside the config, again and again,
    // as a gateway started with `2>gateway.log` next to its config does.
    for n in 0..20 {
        for file in ["gateway.log", "trace.jsonl", "conversations.db"] {
            let mut out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(file))
                .unwrap();
            writeln!(out, "line {n}").unwrap();
        }
    }
    // The first reload is the SIGHUP's alone: had the writes asked for one,
    // it would have come first or named them.
    gateway.hang_up();
    let reloaded = gateway.lines("shallot serve: reloaded", 1);
    assert_eq!(asked(&reloaded[0]), "SIGHUP", "{reloaded:?}");

    // The config and a plugin still do, once each: a SIGHUP after them
    // reloads for itself alone.
    for (n, changed) in [(2, config.clone()), (3, dir.join("safeguard.wasm"))] {
        let bytes = std::fs::read(&changed).unwrap();
        std::fs::write(&changed, bytes).unwrap();
        let reloaded = gateway.lines("shallot serve: reloaded", n);
        let path = changed.display().to_string();
        assert_eq!(asked(&reloaded[n - 1]), path, "{reloaded:?}");
    }
    gateway.hang_up();
    let reloaded = gateway.lines("shallot serve: reloaded", 4);
    assert_eq!(asked(&reloaded[3]), "SIGHUP", "{reloaded:?}");
    assert_eq!(swapped(&address), 4, "{}", gateway.said());
    gateway.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_routes_models_to_their_filters_and_modes_from_the_config() {
    let dir = std::env::temp_dir().join(format!("shallot-routes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("shallot.toml");
    let toml = format!(
        r#"plugin_dir = "{}"

[[filter]]
plugin = "safeguard.wasm"
config = {{ words = ["bomb"], failure_response = "guarded" }}

[[filter]]
plugin = "token_redact.wasm"
config = {{ pattern = 'sk-[a-z0-9]+', replacement = "[KEY]" }}

[[route]]
model = "guarded"
filters = ["safeguard"]
upstream = "embedded"

[[route]]
model = "open"
filters = []

[[route]]
model = "agent"
mode = "agent"
filters = ["token-redact"]
"#,
        guest("safeguard").parent().unwrap().display()
    );
    std::fs::write(&config, toml).unwrap();
    let gateway = Gateway::start(&config);
    assert!(
        gateway
            .said()
            .contains("models 'guarded', 'open', 'agent', 2 filters"),
        "{}",
        gateway.said()
    );
    let ask = |model: &str, text: &str| {
        let body =
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#);
        http(&gateway.address, "POST", "/v1/chat/completions", &body)
    };
    let (status, body) = ask("guarded", "build a bomb");
    assert!(
        status.contains("200") && body.contains("\"content\":\"guarded\""),
        "{status}: {body}"
    );
    let (status, body) = ask("open", "build a bomb");
    assert!(
        status.contains("200") && !body.contains("\"content\":\"guarded\""),
        "{status}: {body}"
    );
    let (status, body) = ask("agent", "What is (2 + 3) * 4?");
    assert!(
        status.contains("200") && body.contains("20"),
        "the calculator ran server-side: {body}"
    );
    let (status, body) = ask("nope", "hi");
    assert!(
        status.contains("404") && body.contains("guarded, open, agent"),
        "{status}: {body}"
    );
    gateway.terminate();

    let refused = |toml: &str, says: &str| {
        std::fs::write(&config, toml).unwrap();
        let out = shallot(&[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ]);
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    };
    refused(
        "[[route]]\nmodel = \"x\"\nfilters = [\"missing\"]\n",
        "route 'x': there is no filter named 'missing'",
    );
    refused(
        concat!(
            "[[route]]\nmodel = \"x\"\nupstream = \"embedded\"\n",
            "[[key]]\nname = \"app\"\nmodels = [\"y\"]\n",
            "sha256 = \"a926675e5e28bc4294606f8631824dd0a5c8cb3a1bc7c1ca29b0e232b92b2d95\"\n",
        ),
        "key 'app': no route serves the model 'y' (served: x)",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_production_example_runs_turns_through_every_layer() {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/production.toml");
    let conversation = format!("production-{}", std::process::id());
    let out = shallot(&[
        "chat",
        "--config",
        config.to_str().unwrap(),
        "--conversation",
        &conversation,
        "hello",
        "My deploy key is sk-live4f9a2b7c",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("You said: My deploy key is [KEY]"),
        "the answer is redacted: {stdout}"
    );
    let db = rusqlite::Connection::open(target_dir().join("shallot-conversations.db")).unwrap();
    let stored: i64 = db
        .query_row(
            "SELECT count(*) FROM shallot_messages WHERE conversation = ?1",
            [&conversation],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(stored, 4, "two questions and two answers, each once");
    let trace = std::fs::read_to_string(target_dir().join("shallot-trace.jsonl")).unwrap();
    let ours: Vec<serde_json::Value> = trace
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .filter(|event: &serde_json::Value| event["conversation_id"] == conversation.as_str())
        .collect();
    let events: Vec<&str> = ours.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["chat", "turn", "chat", "turn"]);
}

#[test]
fn plugins_list_shows_every_built_in_filter() {
    // The built plugins (one per crate under plugins/), without the test
    // guests built beside them.
    let dir = target_dir().join("shallot-test-scratch/built-plugins");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins");
    for entry in std::fs::read_dir(crates).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let Ok(manifest) = std::fs::read_to_string(manifest) else {
            continue;
        };
        let lib = manifest
            .split("[lib]")
            .nth(1)
            .and_then(|lib| lib.lines().find_map(|l| l.strip_prefix("name = ")))
            .expect("each plugin names its lib")
            .trim_matches('"')
            .to_owned();
        let file = format!("{lib}.wasm");
        std::fs::copy(guest(&lib), dir.join(&file)).unwrap();
    }
    // The plugins that cannot run without a configuration get one beside
    // them, as an operator would give it.
    for (lib, config) in [
        ("budget", r#"{"limit_usd": 10, "prices": {}}"#),
        ("model_fallback", r#"{"models": ["backup"]}"#),
        (
            "moderation",
            r#"{"url": "https://api.openai.com/v1/moderations"}"#,
        ),
        ("rate_limit", r#"{"requests": 60}"#),
        ("schema_validation", r#"{"schema": {"type": "object"}}"#),
        ("timeout", r#"{"timeout_ms": 1000}"#),
        ("token_redact", r#"{"pattern": "sk-\\w+"}"#),
    ] {
        std::fs::write(dir.join(format!("{lib}.json")), config).unwrap();
    }
    let out = shallot(&["plugins", "list", "--plugins", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for filter in [
        "approval",
        "budget",
        "cache",
        "call-limit",
        "final-answer",
        "hold-release",
        "logging",
        "memory",
        "model-fallback",
        "moderation",
        "rate-limit",
        "safeguard",
        "schema-validation",
        "summarize",
        "timeout",
        "token-redact",
        "tool-retry",
        "tool-search",
        "trace",
        "validation",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(filter)),
            "{filter} is not listed:\n{stdout}"
        );
    }
}

/// A gateway config whose one filter is `plugin` with `config` (TOML),
/// its `kv` in `store`, with the clock.
fn limited(dir: &std::path::Path, plugin: &str, config: &str, store: &str) -> PathBuf {
    let path = dir.join("shallot.toml");
    let plugins = guest(plugin).parent().unwrap().display().to_string();
    let toml = format!(
        "plugin_dir = {plugins:?}\n[[filter]]\nplugin = \"{plugin}.wasm\"\nconfig = {config}\ngrants = {{ kv = {store:?}, clock = true }}\n"
    );
    std::fs::write(&path, toml).unwrap();
    path
}

/// A plugins directory with a filter that needs a configuration it was not
/// given lists the others and says what that one needs, instead of failing
/// whole.
#[test]
fn plugins_list_shows_a_filter_that_needs_a_configuration_and_what_it_needs() {
    let dir = std::env::temp_dir().join(format!("shallot-unconfigured-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for lib in ["logging", "budget"] {
        std::fs::copy(guest(lib), dir.join(format!("{lib}.wasm"))).unwrap();
    }
    let out = shallot(&["plugins", "list", "--plugins", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let logging = stdout
        .lines()
        .find(|l| l.starts_with("1   logging"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(logging.contains("around-chat"), "{logging}");
    let budget = stdout
        .lines()
        .find(|l| l.starts_with("-   budget"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        budget.contains("needs a configuration") && budget.contains("limit_usd"),
        "{budget}"
    );
    assert!(
        stdout.contains("chat           logging -> model"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plugins check` of a filter that needs a configuration and was given
/// none says it is a filter and what it needs (and fails: it cannot run
/// as it is); with a configuration it checks that one.
#[test]
fn plugins_check_says_what_a_filter_needs_without_its_configuration() {
    let file = guest("token_redact");
    let out = shallot(&["plugins", "check", file.to_str().unwrap()]);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("is a shallot:filter@0.1.5 filter that needs a configuration")
            && stdout.contains("`pattern`")
            && stdout.contains("--with-config"),
        "{stdout}"
    );
    let out = shallot(&[
        "plugins",
        "check",
        file.to_str().unwrap(),
        "--with-config",
        r#"{"pattern": "sk-\\w+"}"#,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("hooks    token-transform"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn plugins_presets_lists_each_preset_with_its_filters_and_grants() {
    let out = shallot(&["plugins", "presets"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let production = stdout
        .split("\n")
        .skip_while(|line| !line.starts_with("production:"))
        .take(4)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        production.contains(r#"call_limit.wasm    {"max_model_calls":15,"on_limit":"halt"}"#)
            && production.contains("tool_retry.wasm")
            && production.contains("grants { sleep_ms = 30000 }"),
        "{stdout}"
    );
    assert!(stdout.contains("human_in_loop:"), "{stdout}");
}

/// `rate-limit` at `limit` requests an hour per user, its counters in `store`.
fn rate_limited(dir: &std::path::Path, limit: u32, store: &str) -> PathBuf {
    let config = format!("{{ requests = {limit}, window_s = 3600, by = \"user\" }}");
    limited(dir, "rate_limit", &config, store)
}

/// Sends `user`'s request to `gateway`: its status line and headers.
fn ask_as(address: &str, user: &str) -> (String, std::collections::HashMap<String, String>) {
    let body = format!(
        r#"{{"model":"shallot-echo","user":"{user}","messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let (status, headers, _) = exchange(address, "POST", "/v1/chat/completions", &body);
    (status, headers)
}

/// Of `count` requests of one user spread over `gateways`, how many
/// passed; every refusal checked to be a `429` whose `Retry-After` is
/// within `wait` seconds.
fn passed_of(
    gateways: &[&Gateway],
    count: usize,
    user: &str,
    wait: std::ops::RangeInclusive<u64>,
) -> usize {
    let mut passed = 0;
    for n in 0..count {
        let (status, headers) = ask_as(&gateways[n % gateways.len()].address, user);
        if status.contains("200") {
            passed += 1;
            continue;
        }
        assert!(status.contains("429"), "{status} {headers:?}");
        let after: u64 = headers["retry-after"].parse().unwrap();
        assert!(wait.contains(&after), "{headers:?}");
    }
    passed
}

#[test]
fn two_gateways_over_one_redis_share_one_rate_limit_and_one_budget() {
    let redis = redis::RedisServer::start();
    let dir = std::env::temp_dir().join(format!("shallot-limits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = rate_limited(&dir, 4, &redis.url());
    let (one, two) = (Gateway::start(&config), Gateway::start(&config));
    let hour = 3500..=3600;
    let passed = passed_of(&[&one, &two], 10, "alice", hour);
    assert_eq!(passed, 4, "{}{}", one.said(), two.said());
    let (status, headers) = ask_as(&two.address, "bob");
    assert!(
        status.contains("200"),
        "another user has a limit of their own: {status}"
    );
    assert_eq!(headers["x-ratelimit-limit-requests"], "4", "{headers:?}");
    assert_eq!(
        headers["x-ratelimit-remaining-requests"], "3",
        "{headers:?}"
    );
    assert!(
        headers["x-ratelimit-reset-requests"].ends_with('s'),
        "{headers:?}"
    );
    one.terminate();
    two.terminate();

    // The echo model's answer to "hi" uses 4 tokens: a dollar a call.
    let budget = "{ limit_usd = 3, period = \"day\", by = \"user\", prices = { \"*\" = { input = 250000, output = 250000 } } }";
    let config = limited(&dir, "budget", budget, &redis.url());
    let (one, two) = (Gateway::start(&config), Gateway::start(&config));
    let passed = passed_of(&[&one, &two], 7, "alice", 1..=86_400);
    assert_eq!(passed, 3, "{}{}", one.said(), two.said());
    one.terminate();
    two.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gateway_keeps_its_rate_limit_in_sqlite_across_a_restart() {
    let dir = std::env::temp_dir().join(format!("shallot-limits-db-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = rate_limited(&dir, 3, "limits.db");
    let gateway = Gateway::start(&config);
    assert_eq!(
        passed_of(&[&gateway], 2, "carol", 3500..=3600),
        2,
        "{}",
        gateway.said()
    );
    gateway.terminate();
    assert!(dir.join("limits.db").is_file(), "relative to the config");
    let gateway = Gateway::start(&config);
    assert_eq!(
        passed_of(&[&gateway], 4, "carol", 3500..=3600),
        1,
        "{}",
        gateway.said()
    );
    gateway.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_streams_a_cached_answer() {
    let dir = std::env::temp_dir().join(format!("shallot-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = limited(&dir, "cache", "{ ttl_s = 60 }", ":memory:");
    let gateway = Gateway::start(&config);
    let ask = |stream: bool| {
        let body = format!(
            r#"{{"model":"shallot-echo","stream":{stream},"messages":[{{"role":"user","content":"cache me"}}]}}"#
        );
        exchange(&gateway.address, "POST", "/v1/chat/completions", &body)
    };
    let (status, headers, first) = ask(false);
    assert!(status.contains("200"), "{status}: {first}");
    assert_eq!(headers["x-shallot-cache"], "miss", "{headers:?}");
    let (_, headers, again) = ask(false);
    assert_eq!(headers["x-shallot-cache"], "hit", "{headers:?}");
    let content = |body: &str| {
        let answer: serde_json::Value = serde_json::from_str(body).unwrap();
        answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(content(&again), content(&first));
    let (status, headers, streamed) = ask(true);
    assert!(status.contains("200"), "{status}");
    assert_eq!(headers["x-shallot-cache"], "hit", "{headers:?}");
    assert!(
        headers["content-type"].starts_with("text/event-stream"),
        "{headers:?}"
    );
    let text: String = streamed
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, content(&first), "{streamed}");
    assert!(streamed.contains("data: [DONE]"), "{streamed}");
    gateway.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `shallot chat` with an `[[mcp]]` server (the test server on the official
/// Python SDK): the embedded model calls the server's tool by name, the
/// call goes through a `trace` filter, and the server's result comes back
/// in the answer.
#[test]
fn chat_calls_an_mcp_servers_tool_through_the_filters() {
    let python = mcp_python();
    let dir = target_dir().join("shallot-test-scratch").join("chat-mcp");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let server = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp/server.py");
    let config = dir.join("shallot.toml");
    let toml = format!(
        "plugin_dir = {plugins:?}\n\n[[filter]]\nplugin = \"trace.wasm\"\ngrants = {{ trace = \"trace.jsonl\" }}\nconfig = {{ arguments = true, results = true }}\n\n[[mcp]]\nname = \"test\"\ncommand = {python:?}\nargs = [{server:?}]\n",
        plugins = guest("trace").parent().unwrap().display().to_string(),
        python = python.display().to_string(),
        server = server.display().to_string(),
    );
    std::fs::write(&config, toml).unwrap();
    let out = shallot(&[
        "chat",
        "--config",
        config.to_str().unwrap(),
        r#"call test_echo {"text": "via MCP"}"#,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("via MCP"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("starting the MCP server 'test'"),
        "{}",
        text(&out.stderr)
    );
    let trace = std::fs::read_to_string(dir.join("trace.jsonl")).unwrap();
    let tool: serde_json::Value = trace
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .find(|event| event["event"] == "tool")
        .unwrap_or_else(|| panic!("no tool line: {trace}"));
    assert_eq!(tool["tool"], "test_echo");
    assert_eq!(tool["arguments"], serde_json::json!({ "text": "via MCP" }));
}

/// The venv's Python with the `mcp` package (`scripts/build-polyglot`).
fn mcp_python() -> PathBuf {
    let python = target_dir().join("polyglot/venv/bin/python");
    let has_mcp = Command::new(&python)
        .args(["-c", "import mcp"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_mcp,
        "{} has no mcp package: run scripts/build-polyglot",
        python.display()
    );
    python
}

/// What the official Python MCP client (`tests/mcp/client.py`) says of
/// `args` against the gateway at `address`, without a key.
fn mcp_client(address: &str, args: &[&str]) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp/client.py");
    let out = Command::new(mcp_python())
        .arg(script)
        .args([&format!("http://{address}/mcp"), "-"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The Python client listening for `/mcp`'s changes at `address`
/// (`client.py watch`), and the lines it prints as they come.
fn mcp_watch(address: &str) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp/client.py");
    let mut child = Command::new(mcp_python())
        .arg(script)
        .args([&format!("http://{address}/mcp"), "-", "watch"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, heard) = std::sync::mpsc::channel();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    (child, heard)
}

/// The next thing a watching client says, as JSON.
fn heard(lines: &std::sync::mpsc::Receiver<String>) -> serde_json::Value {
    let line = lines
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the watching client says something within a minute");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// `shallot serve` serves `/mcp` over an `[[mcp]]` server; when the server
/// says its tools changed, the gateway is rebuilt over the same server
/// (not started again: the tool it added is there) and a client listening
/// is told, and a flood of such notices with nothing changed rebuilds
/// nothing. The shutdown ends the listen gracefully.
#[test]
fn serve_offers_an_mcp_servers_new_tools_after_it_says_they_changed() {
    let dir = target_dir().join("shallot-test-scratch").join("serve-mcp");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let server = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp/server.py");
    let config = dir.join("shallot.toml");
    let toml = format!(
        "[[mcp]]\nname = \"test\"\ncommand = {python:?}\nargs = [{server:?}]\n\n[mcp_gateway]\n",
        python = mcp_python().display().to_string(),
        server = server.display().to_string(),
    );
    std::fs::write(&config, toml).unwrap();
    let gateway = Gateway::start(&config);
    let listed = mcp_client(&gateway.address, &["list"]);
    let listed = listed.as_array().unwrap();
    assert!(!listed.contains(&"test_late".into()));
    let tools = |n: usize| format!("/mcp with {n} tools");
    assert!(
        gateway.said().contains(&tools(listed.len())),
        "{}",
        gateway.said()
    );

    let (mut watching, lines) = mcp_watch(&gateway.address);
    assert_eq!(heard(&lines).as_array().unwrap(), listed);

    let churned = mcp_client(
        &gateway.address,
        &["call", "test_churn", r#"{"times": 300}"#],
    );
    assert_eq!(churned["structured"]["result"], "churned", "{churned}");
    let grown = mcp_client(
        &gateway.address,
        &["call", "test_grow", r#"{"name": "late"}"#],
    );
    assert_eq!(grown["structured"]["result"], "added late", "{grown}");
    let reloaded = gateway.lines("shallot serve: reloaded", 1);
    assert_eq!(
        asked(&reloaded[0]),
        "the tools of the MCP server 'test'",
        "{reloaded:?}"
    );
    assert!(
        reloaded[0].contains(&tools(listed.len() + 1)),
        "{reloaded:?}"
    );
    let late = mcp_client(&gateway.address, &["call", "test_late", "{}"]);
    assert_eq!(late["structured"]["result"], "I am late", "{late}");
    let told = heard(&lines);
    assert!(
        told.as_array().unwrap().contains(&"test_late".into()),
        "{told}"
    );
    assert_eq!(swapped(&gateway.address), 1, "the churn rebuilt nothing");
    gateway.terminate();
    assert_eq!(heard(&lines), serde_json::json!({ "ended": "closed" }));
    assert!(watching.wait().unwrap().success());
}

/// The reference MCP server (`@modelcontextprotocol/server-everything`,
/// pinned in tests/mcp/package-lock.json, installed by
/// `scripts/build-polyglot`).
fn everything() -> PathBuf {
    let server = target_dir()
        .join("polyglot/mcp/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    assert!(
        server.is_file(),
        "{} is missing: run scripts/build-polyglot",
        server.display()
    );
    server
}

/// `shallot chat` on an agent turn reaches a third party's MCP server, the
/// MCP project's reference server on its TypeScript SDK, over stdio and
/// over streamable HTTP: the model's call goes through `trace` (its line
/// has the arguments and the result) and the server's answer comes back.
#[test]
fn chat_reaches_the_reference_mcp_server_over_stdio_and_http() {
    let dir = target_dir()
        .join("shallot-test-scratch")
        .join("chat-everything");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut http = Command::new("node")
        .arg(everything())
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("node runs");
    // It says so on stderr once it listens; the rest is drained.
    let mut said = BufReader::new(http.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on port") {
        line.clear();
        assert!(said.read_line(&mut line).unwrap() > 0, "it never listened");
    }
    std::thread::spawn(move || said.lines().for_each(drop));
    let plugins = guest("trace").parent().unwrap().display().to_string();
    let ways = [
        (
            "stdio",
            format!(
                "command = \"node\"\nargs = [{:?}, \"stdio\"]",
                everything().display().to_string()
            ),
        ),
        ("http", format!("url = \"http://127.0.0.1:{port}/mcp\"")),
    ];
    for (way, server) in ways {
        let config = dir.join(format!("{way}.toml"));
        let trace = dir.join(format!("{way}.jsonl"));
        let toml = format!(
            "plugin_dir = {plugins:?}\n\n[[filter]]\nplugin = \"trace.wasm\"\n\
             grants = {{ trace = {trace:?} }}\nconfig = {{ arguments = true, results = true }}\n\n\
             [[mcp]]\nname = \"everything\"\n{server}\n",
            trace = trace.display().to_string(),
        );
        std::fs::write(&config, toml).unwrap();
        let out = shallot(&[
            "chat",
            "--config",
            config.to_str().unwrap(),
            r#"call everything_get-sum {"a": 2, "b": 40}"#,
        ]);
        assert!(out.status.success(), "{way}: {}", text(&out.stderr));
        let answer = text(&out.stdout);
        assert!(
            answer.contains("The sum of 2 and 40 is 42"),
            "{way}: {answer}"
        );
        let trace = std::fs::read_to_string(&trace).unwrap();
        let tool: serde_json::Value = trace
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .find(|event| event["event"] == "tool")
            .unwrap_or_else(|| panic!("{way}: no tool line: {trace}"));
        assert_eq!(tool["tool"], "everything_get-sum", "{way}");
        assert_eq!(tool["arguments"], serde_json::json!({ "a": 2, "b": 40 }));
        assert_eq!(tool["output"], "The sum of 2 and 40 is 42.", "{way}");
    }
    let _ = http.kill();
    let _ = http.wait();
}
