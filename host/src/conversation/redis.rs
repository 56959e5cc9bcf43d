//! Conversations in Redis: a list per conversation
//! (`shallot:conversation:<id>`), one JSON message per element, its size
//! as stored beside it (`shallot:conversation-bytes:<id>`), the store's
//! (`shallot:conversation-bytes`) and each owner's part's
//! (`shallot:conversation-parts`, a field per owner), all changed together in server-side
//! scripts, so the bounds hold for every host sharing the server. The
//! connection manager reconnects after Redis comes back; every operation
//! is bounded, so Redis going away is a `transient` error, never a hang.

use async_trait::async_trait;

use super::{
    CONVERSATION_CAP, ConversationStore, LOAD_LIMIT, PART_CAP, STORE_CAP, fits_a_conversation,
    full, part, part_full, row_overhead, unavailable,
};
use crate::store::{Connected, OPERATION_TIMEOUT, connect_redis};
use crate::types::{ChainError, Message};

pub(super) struct Redis {
    server: Connected,
}

fn key(conversation: &str) -> String {
    format!("shallot:conversation:{conversation}")
}

fn size_key(conversation: &str) -> String {
    format!("shallot:conversation-bytes:{conversation}")
}

/// The store's size as stored, over all conversations.
const STORE_SIZE_KEY: &str = "shallot:conversation-bytes";
/// Each owner's part's size as stored, a field per owner.
const PARTS_KEY: &str = "shallot:conversation-parts";
/// What the append script answers when the store is full.
const FULL: &str = "shallot-store-full";
/// What it answers when the owner's part is.
const PART_FULL: &str = "shallot-part-full";

impl Redis {
    /// Connects (within the operation timeout) and checks the server answers.
    pub(super) async fn open(url: &str) -> Result<Self, String> {
        Ok(Redis {
            server: connect_redis(url, "grants.memory").await?,
        })
    }

    /// Runs one operation within the timeout.
    async fn bounded<T>(
        &self,
        operation: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, ChainError> {
        let shown = &self.server.shown;
        self.server
            .health
            .may_try()
            .map_err(|why| unavailable("Redis", shown, why))?;
        let result = match tokio::time::timeout(OPERATION_TIMEOUT, operation).await {
            Ok(result) => result.map_err(|e| unavailable("Redis", shown, e)),
            Err(_) => Err(unavailable(
                "Redis",
                shown,
                format!("no answer within {OPERATION_TIMEOUT:?}"),
            )),
        };
        self.server.answered(result)
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

/// Appends `ARGV[6..]` to the list `KEYS[1]` whose size is `KEYS[2]`, in a
/// store whose size is `KEYS[3]`, each element counting `ARGV[3]` bytes
/// more than its own: the list's oldest elements go while it is over
/// `ARGV[1]` bytes (popped a page at a time from the head, what went too
/// far pushed back: linear in what is dropped); nothing is written if the
/// store would go past `ARGV[2]`, or the part `ARGV[4]` (none if empty)
/// of the parts' sizes `KEYS[4]` past `ARGV[5]`.
const APPEND_WITHIN: &str = r"
local conversation_cap, store_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local overhead = tonumber(ARGV[3])
local part, part_cap = ARGV[4], tonumber(ARGV[5])
local added = 0
for i = 6, #ARGV do added = added + #ARGV[i] + overhead end
local size = tonumber(redis.call('GET', KEYS[2]) or '0')
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local over = size + added - conversation_cap
-- Trimming frees at least this much (all of the list if it is smaller).
local freeing = math.min(math.max(over, 0), size)
if total - freeing + added > store_cap then return 'shallot-store-full' end
local held = 0
if part ~= '' then
  held = tonumber(redis.call('HGET', KEYS[4], part) or '0')
  if held - freeing + added > part_cap then return 'shallot-part-full' end
end
local freed = 0
while freed < over do
  local page = redis.call('LPOP', KEYS[1], 64)
  if not page then break end
  local kept = 1
  while kept <= #page and freed < over do
    freed = freed + #page[kept] + overhead
    kept = kept + 1
  end
  for j = #page, kept, -1 do redis.call('LPUSH', KEYS[1], page[j]) end
end
for i = 6, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('SET', KEYS[2], math.max(0, size - freed) + added)
redis.call('INCRBY', KEYS[3], added - freed)
if part ~= '' then redis.call('HSET', KEYS[4], part, math.max(0, held - freed + added)) end
return 'OK'
";

/// Deletes the list `KEYS[1]` and its size `KEYS[2]`, taking that from
/// the store's size `KEYS[3]` and from the part `ARGV[1]` (none if empty)
/// of the parts' sizes `KEYS[4]`.
const CLEAR: &str = r"
local size = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('DECRBY', KEYS[3], size)
if ARGV[1] ~= '' then
  local held = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
  redis.call('HSET', KEYS[4], ARGV[1], math.max(0, held - size))
end
return 'OK'
";

#[async_trait]
impl ConversationStore for Redis {
    async fn load(&self, conversation: &str, max_bytes: usize) -> Result<Vec<Message>, ChainError> {
        let mut connection = self.server.connection.clone();
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
                        "Redis",
                        &self.server.shown,
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
        let overhead = row_overhead(conversation);
        fits_a_conversation(rows.iter().map(|row| row.len() + overhead).sum())?;
        let mut connection = self.server.connection.clone();
        let mut append = redis::cmd("EVAL");
        append
            .arg(APPEND_WITHIN)
            .arg(4)
            .arg(key(conversation))
            .arg(size_key(conversation))
            .arg(STORE_SIZE_KEY)
            .arg(PARTS_KEY)
            .arg(CONVERSATION_CAP)
            .arg(STORE_CAP)
            .arg(overhead)
            .arg(part(conversation))
            .arg(PART_CAP)
            .arg(rows);
        let answer: String = self.bounded(append.query_async(&mut connection)).await?;
        match answer.as_str() {
            FULL => Err(full("Redis", &self.server.shown, STORE_CAP)),
            PART_FULL => Err(part_full("Redis", PART_CAP)),
            _ => Ok(()),
        }
    }

    async fn clear(&self, conversation: &str) -> Result<(), ChainError> {
        let mut connection = self.server.connection.clone();
        let mut clear = redis::cmd("EVAL");
        clear
            .arg(CLEAR)
            .arg(4)
            .arg(key(conversation))
            .arg(size_key(conversation))
            .arg(STORE_SIZE_KEY)
            .arg(PARTS_KEY)
            .arg(part(conversation));
        self.bounded(clear.query_async::<String>(&mut connection))
            .await
            .map(drop)
    }
}
