//! The MCP test server (`tests/mcp/server.py`, on the official Python
//! SDK) as the tests and benchmarks start it: its Python, its `[[mcp]]`
//! table over stdio, and the server over streamable HTTP.

use std::path::PathBuf;

use shallot::McpConfig;

use crate::target_dir;

/// The polyglot venv's Python, which has the `mcp` package (installed by
/// `scripts/build-polyglot`); fails the caller saying so when it has not.
pub fn mcp_python() -> PathBuf {
    let python = target_dir().join("polyglot/venv/bin/python");
    let has_mcp = std::process::Command::new(&python)
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

/// `tests/mcp/<name>`.
pub fn mcp_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("mcp")
        .join(name)
}

/// The test server over stdio, as an `[[mcp]]` table named `test` names
/// it: `timeout_ms`, messages of at most 64 KiB.
pub fn mcp_test_server(timeout_ms: u64) -> McpConfig {
    McpConfig {
        name: "test".into(),
        prefix: None,
        command: Some(mcp_python().display().to_string()),
        url: None,
        headers: Default::default(),
        args: vec![mcp_script("server.py").display().to_string()],
        env: Default::default(),
        timeout_ms,
        start_timeout_ms: None,
        max_message_kib: 64,
    }
}

/// The test server over streamable HTTP on a free loopback port, once it
/// listens (at most 30 s, then the caller fails); killed when dropped.
pub struct McpHttpServer {
    process: std::process::Child,
    /// Its endpoint, `http://127.0.0.1:PORT/mcp`.
    pub url: String,
}

impl McpHttpServer {
    pub async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let process = std::process::Command::new(mcp_python())
            .arg(mcp_script("server.py"))
            .args(["--http", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the HTTP server never listened"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        McpHttpServer {
            process,
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }
}

impl Drop for McpHttpServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
