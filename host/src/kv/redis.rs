//! Keys in Redis: a hash per key (`shallot:kv:<namespace length>:<namespace>:<key>`)
//! holding its value (`v`) and version (`n`), the versions drawn from one
//! counter (`shallot:kv-version`), every write a server-side script, so
//! that compare-and-set and add are atomic for every host sharing the
//! server. Expiry is Redis's own (`PEXPIRE`). Every operation is bounded:
//! Redis going away is a `transient` error, never a hang.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::ConnectionManager;

use super::{Count, Entry, KvStore, OPERATION_TIMEOUT, stored_key, unavailable};
use crate::conversation::connect_redis;
use crate::types::{ChainError, ErrorKind};

pub(super) struct Redis {
    /// The address without credentials, for messages.
    shown: String,
    connection: ConnectionManager,
}

const VERSION_KEY: &str = "shallot:kv-version";

fn key(namespace: &str, key: &str) -> String {
    format!("shallot:kv:{}", stored_key(namespace, key))
}

fn millis(ttl: Option<Duration>) -> u64 {
    ttl.map_or(0, |ttl| (ttl.as_millis() as u64).max(1))
}

/// Writes `ARGV[1]` to the hash `KEYS[1]` with a new version from
/// `KEYS[2]`, to expire after `ARGV[2]` ms (0: never); when `ARGV[3]` is
/// given, only if the key's version is still it (0: absent).
const WRITE: &str = r"
if ARGV[3] and (redis.call('HGET', KEYS[1], 'n') or '0') ~= ARGV[3] then return false end
local n = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'n', n)
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return n
";

/// Adds `ARGV[1]` to the counter `KEYS[1]` (Redis's own 64-bit add, which
/// refuses a non-integer and an overflow before anything is written), a
/// new version from `KEYS[2]`; a counter this creates expires after
/// `ARGV[2]` ms (0: never). Answers the count and its time left.
const ADD: &str = r"
local created = redis.call('EXISTS', KEYS[1]) == 0
local v = redis.call('HINCRBY', KEYS[1], 'v', ARGV[1])
redis.call('HSET', KEYS[1], 'n', redis.call('INCR', KEYS[2]))
if created and tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {v, redis.call('PTTL', KEYS[1])}
";

impl Redis {
    /// Connects (within the operation timeout) and checks the server answers.
    pub(super) async fn open(url: &str) -> Result<Self, String> {
        let (shown, connection) = connect_redis(url, "grants.kv").await?;
        Ok(Redis { shown, connection })
    }

    /// Runs `command` within the timeout. What Redis refuses as a value
    /// (a counter that holds no integer, an add that overflows) is the
    /// caller's `invalid-request`; anything else is the store failing.
    async fn run<T: redis::FromRedisValue>(&self, command: redis::Cmd) -> Result<T, ChainError> {
        let mut connection = self.connection.clone();
        let answer = tokio::time::timeout(OPERATION_TIMEOUT, command.query_async(&mut connection));
        match answer.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) if refused_value(&e) => Err(ChainError::new(
                ErrorKind::InvalidRequest,
                "the key holds a value that is not a decimal integer, or the add would go past the 64-bit range",
            )),
            Ok(Err(e)) => Err(unavailable("Redis", &self.shown, e)),
            Err(_) => Err(unavailable(
                "Redis",
                &self.shown,
                format!("no answer within {OPERATION_TIMEOUT:?}"),
            )),
        }
    }

    fn write(&self, namespace: &str, name: &str, value: &str, ttl: Option<Duration>) -> redis::Cmd {
        let mut write = redis::cmd("EVAL");
        write
            .arg(WRITE)
            .arg(2)
            .arg(key(namespace, name))
            .arg(VERSION_KEY)
            .arg(value)
            .arg(millis(ttl));
        write
    }
}

fn refused_value(e: &redis::RedisError) -> bool {
    let said = e.to_string();
    said.contains("not an integer") || said.contains("overflow")
}

#[async_trait]
impl KvStore for Redis {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Entry>, ChainError> {
        let mut get = redis::cmd("HMGET");
        get.arg(key(namespace, name)).arg("v").arg("n");
        let (value, version): (Option<String>, Option<u64>) = self.run(get).await?;
        Ok(value
            .zip(version)
            .map(|(value, version)| Entry { value, version }))
    }

    async fn set(
        &self,
        namespace: &str,
        name: &str,
        value: &str,
        ttl: Option<Duration>,
    ) -> Result<u64, ChainError> {
        self.run(self.write(namespace, name, value, ttl)).await
    }

    async fn swap(
        &self,
        namespace: &str,
        name: &str,
        value: &str,
        version: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, ChainError> {
        let mut swap = self.write(namespace, name, value, ttl);
        swap.arg(version);
        self.run(swap).await
    }

    async fn add(
        &self,
        namespace: &str,
        name: &str,
        delta: i64,
        ttl: Option<Duration>,
    ) -> Result<Count, ChainError> {
        let mut add = redis::cmd("EVAL");
        add.arg(ADD)
            .arg(2)
            .arg(key(namespace, name))
            .arg(VERSION_KEY)
            .arg(delta)
            .arg(millis(ttl));
        let (value, left): (i64, i64) = self.run(add).await?;
        let ttl = (left > 0).then(|| Duration::from_millis(left as u64));
        Ok(Count { value, ttl })
    }

    async fn delete(&self, namespace: &str, name: &str) -> Result<bool, ChainError> {
        let mut delete = redis::cmd("DEL");
        delete.arg(key(namespace, name));
        let deleted: u64 = self.run(delete).await?;
        Ok(deleted > 0)
    }
}
