//! Conversations in Redis: a list per conversation
//! (`shallot:conversation:<id>`), one JSON message per element. The
//! connection manager reconnects after Redis comes back; every operation
//! is bounded, so Redis going away is a `transient` error, never a hang.

use async_trait::async_trait;
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{ConversationStore, LOAD_LIMIT, OPERATION_TIMEOUT, unavailable};
use crate::types::{ChainError, Message};

pub(super) struct Redis {
    /// The address without credentials, for messages.
    shown: String,
    connection: ConnectionManager,
}

fn key(conversation: &str) -> String {
    format!("shallot:conversation:{conversation}")
}

impl Redis {
    /// Connects (within the operation timeout) and checks the server answers.
    pub(super) async fn open(url: &str) -> Result<Self, String> {
        let client =
            redis::Client::open(url).map_err(|e| format!("grants.memory: not a Redis URL: {e}"))?;
        let info = client.get_connection_info();
        let shown = format!("redis at {}", info.addr);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(OPERATION_TIMEOUT)
            .set_response_timeout(OPERATION_TIMEOUT)
            .set_number_of_retries(1);
        let mut connection = tokio::time::timeout(
            OPERATION_TIMEOUT * 2,
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| format!("grants.memory: {shown} did not answer within {OPERATION_TIMEOUT:?}"))?
        .map_err(|e| format!("grants.memory: cannot reach {shown}: {e}"))?;
        let _: String = redis::cmd("PING")
            .query_async(&mut connection)
            .await
            .map_err(|e| format!("grants.memory: cannot reach {shown}: {e}"))?;
        Ok(Redis { shown, connection })
    }

    /// Runs one operation within the timeout.
    async fn bounded<T>(
        &self,
        operation: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, ChainError> {
        match tokio::time::timeout(OPERATION_TIMEOUT, operation).await {
            Ok(result) => result.map_err(|e| unavailable(&self.shown, e)),
            Err(_) => Err(unavailable(
                &self.shown,
                format!("no answer within {OPERATION_TIMEOUT:?}"),
            )),
        }
    }
}

/// The latest messages of the list `KEYS[1]`, newest first: at most
/// `ARGV[1]` of them, no more than fit in `ARGV[2]` bytes. Read on the
/// server a page at a time, so that what comes back is bounded.
const LATEST_THAT_FIT: &str = r"
local key, limit, budget = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local stop = redis.call('LLEN', key) - 1
local first = math.max(0, stop + 1 - limit)
local out, bytes = {}, 0
while stop >= first do
  local start = math.max(first, stop - 63)
  local page = redis.call('LRANGE', key, start, stop)
  for i = #page, 1, -1 do
    bytes = bytes + #page[i]
    if bytes > budget then return out end
    out[#out + 1] = page[i]
  end
  stop = start - 1
end
return out
";

#[async_trait]
impl ConversationStore for Redis {
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError> {
        let mut connection = self.connection.clone();
        let mut load = redis::cmd("EVAL");
        load.arg(LATEST_THAT_FIT)
            .arg(1)
            .arg(key(conversation))
            .arg(LOAD_LIMIT)
            .arg(max_bytes);
        let mut rows: Vec<String> = self.bounded(load.query_async(&mut connection)).await?;
        rows.reverse();
        rows.iter()
            .map(|row| {
                serde_json::from_str(row).map_err(|e| {
                    unavailable(
                        &self.shown,
                        format!("a stored message is not readable: {e}"),
                    )
                })
            })
            .collect()
    }

    async fn append(&self, conversation: &str, messages: &[Message]) -> Result<(), ChainError> {
        if messages.is_empty() {
            return Ok(());
        }
        let rows: Vec<String> = messages
            .iter()
            .map(|m| serde_json::to_string(m).expect("a message serializes"))
            .collect();
        let mut connection = self.connection.clone();
        self.bounded(connection.rpush::<_, _, ()>(key(conversation), rows))
            .await
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        let mut connection = self.connection.clone();
        self.bounded(connection.del::<_, ()>(key(conversation)))
            .await
    }
}
