//! A real `redis-server` (Debian's package; `.ci/run` installs it) that a
//! test starts on a free loopback port, stops and starts again.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server process on `127.0.0.1:port`, without persistence;
/// killed when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// What it is started with beside its port (`--maxmemory`, say).
    settings: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// The same, started with `settings` too.
    pub fn start_with(settings: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let settings = settings.iter().map(|s| s.to_string()).collect();
        let mut server = RedisServer {
            port,
            child: None,
            settings,
        };
        server.resume();
        server
    }

    /// The URL of its database 0.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills the server (its data is gone: it keeps none on disk).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and waits until it answers.
    pub fn resume(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(&self.settings)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (install Debian's redis-server package; .ci/run does)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.answers() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn answers(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let mut reply = [0u8; 5];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && &reply == b"+PONG"
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
