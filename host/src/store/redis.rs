//! A connection to a Redis server, shared by the stores that keep their
//! state there: it reconnects after the server comes back, every
//! operation is bounded, and the server's record says how it answered.

use std::sync::Arc;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::OPERATION_TIMEOUT;
use super::health::{self, Health};
use crate::types::{Cause, ChainError};

/// A connection to a Redis server: its address without credentials (for
/// messages and `/readyz`), the connection, and the server's record of
/// how it has answered.
pub(crate) struct Connected {
    pub shown: String,
    pub connection: ConnectionManager,
    pub health: Arc<Health>,
}

impl Connected {
    /// Records `result` of an operation on the server: a store failure
    /// marks it down; anything else (an answer, or a refusal such as a
    /// full store) up.
    pub(crate) fn answered<T>(&self, result: Result<T, ChainError>) -> Result<T, ChainError> {
        match &result {
            Err(e) if e.cause == Some(Cause::StoreUnavailable) => self.health.failed(&e.message),
            _ => self.health.answered(),
        }
        result
    }
}

/// Connects to the Redis server at `url` (within the operation timeout,
/// retrying once) and checks that it answers: the address shown in
/// messages (without credentials) and the connection, which reconnects
/// after the server comes back. Errors name `grant`.
pub(crate) async fn connect(url: &str, grant: &str) -> Result<Connected, String> {
    if url.starts_with("redis+sentinel") {
        return Err(format!(
            "{grant}: Redis Sentinel is not supported: give the primary's address (redis://host:port/db), and a new one after a failover"
        ));
    }
    let client = redis::Client::open(url).map_err(|e| format!("{grant}: not a Redis URL: {e}"))?;
    let shown = format!("redis at {}", client.get_connection_info().addr);
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(OPERATION_TIMEOUT)
        .set_response_timeout(OPERATION_TIMEOUT)
        .set_number_of_retries(1);
    let mut connection = tokio::time::timeout(
        OPERATION_TIMEOUT * 2,
        client.get_connection_manager_with_config(config),
    )
    .await
    .map_err(|_| format!("{grant}: {shown} did not answer within {OPERATION_TIMEOUT:?}"))?
    .map_err(|e| format!("{grant}: cannot reach {shown}: {e}"))?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut connection)
        .await
        .map_err(|e| format!("{grant}: cannot reach {shown}: {e}"))?;
    standalone(&info).map_err(|why| format!("{grant}: {shown} {why}"))?;
    let health = health::register(&shown);
    Ok(Connected {
        shown,
        connection,
        health,
    })
}

/// Refuses a server that is not one standalone Redis, by its `INFO
/// server`: a Cluster node (each operation's keys change together in one
/// script, so they must live on one server) or a Sentinel (it keeps no
/// data).
fn standalone(info: &str) -> Result<(), String> {
    let mode = info
        .lines()
        .find_map(|line| line.trim().strip_prefix("redis_mode:"))
        .unwrap_or("standalone");
    match mode {
        "standalone" => Ok(()),
        "cluster" => Err(
            "is a Redis Cluster node, which is not supported: a store's keys change together in one script on one server; give a standalone Redis (or a primary with replicas)"
                .to_owned(),
        ),
        "sentinel" => Err(
            "is a Redis Sentinel, which keeps no data: give the primary's address it names".to_owned(),
        ),
        other => Err(format!("runs in mode '{other}', not a standalone Redis")),
    }
}

#[cfg(test)]
mod tests {
    use super::standalone;

    #[test]
    fn only_a_standalone_server_is_taken() {
        assert!(
            standalone("# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n").is_ok()
        );
        assert!(
            standalone("redis_version:7.0.15\r\n").is_ok(),
            "older servers say no mode"
        );
        let cluster = standalone("redis_mode:cluster\r\n").unwrap_err();
        assert!(
            cluster.contains("Cluster") && cluster.contains("not supported"),
            "{cluster}"
        );
        let sentinel = standalone("redis_mode:sentinel\r\n").unwrap_err();
        assert!(sentinel.contains("Sentinel"), "{sentinel}");
    }
}
