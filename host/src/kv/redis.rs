//! Keys in Redis: a hash per key (`shallot:kv:<namespace length>:<namespace>:<key>`)
//! holding its value (`v`) and version (`n`), the versions drawn from one
//! counter (`shallot:kv-version`), every write a server-side script, so
//! that compare-and-set and add are atomic for every host sharing the
//! server. Expiry is Redis's own (`PEXPIRE`). Every operation is bounded:
//! Redis going away is a `transient` error, never a hang.
//!
//! Each namespace holds at most [`STORED_NAMESPACE_CAP`] bytes, counted as
//! its keys are written (`shallot:kv-bytes`, a field per namespace) with
//! each key's size (`shallot:kv-sizes:<namespace>`) and, for a key that
//! expires, its expiry (`shallot:kv-expiring:<namespace>`, scored in
//! milliseconds): a write gives back the sizes of keys that expired, a
//! few at a time and all before it is refused, so a namespace is never
//! full of keys Redis has already forgotten. A Redis past its own
//! `maxmemory` refuses a write as full too (`limit-exceeded`), not as a
//! failure worth retrying.

use std::time::Duration;

use async_trait::async_trait;

mod windows;

use super::{
    Count, ENTRY_BYTES, Entry, KvStore, OPERATION_TIMEOUT, Period, STORED_NAMESPACE_CAP, Taken,
    Window, full, owner_cap, owner_full, stored_key, unavailable,
};
use crate::store::{Connected, connect_redis};
use crate::types::{ChainError, ErrorKind};

pub(super) struct Redis {
    server: Connected,
}

const VERSION_KEY: &str = "shallot:kv-version";
const BYTES_KEY: &str = "shallot:kv-bytes";

fn key(namespace: &str, key: &str) -> String {
    format!("shallot:kv:{}", stored_key(namespace, key))
}

fn millis(ttl: Option<Duration>) -> u64 {
    ttl.map_or(0, |ttl| (ttl.as_millis() as u64).max(1))
}

/// The keys a script names for `name` of `namespace`: the key, the
/// version counter, the namespaces' bytes, the namespace's sizes, its
/// expiring keys, each key's owner and each owner's bytes. The namespace
/// is written length first, as in the key.
fn keys(namespace: &str, name: &str) -> [String; 7] {
    let space = format!("{}:{namespace}", namespace.len());
    [
        key(namespace, name),
        VERSION_KEY.to_owned(),
        BYTES_KEY.to_owned(),
        format!("shallot:kv-sizes:{space}"),
        format!("shallot:kv-expiring:{space}"),
        format!("shallot:kv-owners:{space}"),
        format!("shallot:kv-owner-bytes:{space}"),
    ]
}

/// What every script starts with: `now` in ms; `give(name, size)`, which
/// takes `size` bytes of `name` back from its namespace (`ARGV[4]`, in
/// `KEYS[3]`) and its owner (`KEYS[6]`, in `KEYS[7]`); `sweep(most)`,
/// which gives back up to `most` keys that have expired (`KEYS[4]` the
/// sizes, `KEYS[5]` the expiring); `room(name, size)`, what stops writing
/// `size` bytes under `name` for the owner `ARGV[8]` (`''`: none) within
/// the namespace's `ARGV[5]` and the owner's `ARGV[9]` (nothing, or
/// `'full'` or `'owner-full'`), sweeping the namespace whole before it
/// says so; and `account(name, size, ttl)`, which counts a write.
const ACCOUNT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = ARGV[8]
local function give(name, size)
  local was = redis.call('HGET', KEYS[6], name)
  redis.call('HDEL', KEYS[6], name)
  if size > 0 then
    redis.call('HINCRBY', KEYS[3], ARGV[4], 0 - size)
    if was then redis.call('HINCRBY', KEYS[7], was, 0 - size) end
  end
end
local function sweep(most)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, most)
  for _, name in ipairs(gone) do
    local size = tonumber(redis.call('HGET', KEYS[4], name) or '0')
    redis.call('HDEL', KEYS[4], name)
    redis.call('ZREM', KEYS[5], name)
    give(name, size)
  end
  return #gone
end
local function stops(name, size)
  local old = tonumber(redis.call('HGET', KEYS[4], name) or '0')
  local held = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
  if held - old + size > tonumber(ARGV[5]) then return 'full' end
  if owner ~= '' then
    local mine = 0
    if redis.call('HGET', KEYS[6], name) == owner then mine = old end
    local own = tonumber(redis.call('HGET', KEYS[7], owner) or '0')
    if own - mine + size > tonumber(ARGV[9]) then return 'owner-full' end
  end
  return nil
end
local function room(name, size)
  sweep(64)
  if not stops(name, size) then return nil end
  while sweep(1024) > 0 do end
  return stops(name, size)
end
local function account(name, size, ttl)
  local old = tonumber(redis.call('HGET', KEYS[4], name) or '0')
  give(name, old)
  redis.call('HSET', KEYS[4], name, size)
  redis.call('HINCRBY', KEYS[3], ARGV[4], size)
  if owner ~= '' then
    redis.call('HSET', KEYS[6], name, owner)
    redis.call('HINCRBY', KEYS[7], owner, size)
  end
  if ttl > 0 then
    redis.call('ZADD', KEYS[5], now + ttl, name)
  else
    redis.call('ZREM', KEYS[5], name)
  end
end
";

/// Writes `ARGV[1]` to the hash `KEYS[1]` with a new version from
/// `KEYS[2]`, to expire after `ARGV[2]` ms (0: never), its size `ARGV[6]`
/// (`ARGV[7]` the key's name in the namespace); when `ARGV[3]` is not
/// empty, only if the key's version is still it (0: absent). Answers the
/// version, `false` for a stale one, or what stops it.
const WRITE: &str = r"
if ARGV[3] ~= '' and (redis.call('HGET', KEYS[1], 'n') or '0') ~= ARGV[3] then return false end
local size = tonumber(ARGV[6])
local stopped = room(ARGV[7], size)
if stopped then return stopped end
local n = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'n', n)
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
account(ARGV[7], size, ttl)
return n
";

/// Adds `ARGV[1]` to the counter `KEYS[1]` (Redis's own 64-bit add, which
/// refuses a non-integer and an overflow before anything is written), a
/// new version from `KEYS[2]`; a counter this creates expires after
/// `ARGV[2]` ms (0: never), and counts `ARGV[6]` bytes (`ARGV[7]` its
/// name) in its creator's part. Answers the count and its time left, or
/// what stops it.
const ADD: &str = r"
local created = redis.call('EXISTS', KEYS[1]) == 0
if created then
  local stopped = room(ARGV[7], tonumber(ARGV[6]))
  if stopped then return stopped end
end
local v = redis.call('HINCRBY', KEYS[1], 'v', ARGV[1])
redis.call('HSET', KEYS[1], 'n', redis.call('INCR', KEYS[2]))
if created then
  local ttl = tonumber(ARGV[2])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
  account(ARGV[7], tonumber(ARGV[6]), ttl)
end
return {v, redis.call('PTTL', KEYS[1])}
";

/// Deletes the key `KEYS[1]` (`ARGV[7]` its name) and gives back its size.
const DELETE: &str = r"
local deleted = redis.call('DEL', KEYS[1])
local size = tonumber(redis.call('HGET', KEYS[4], ARGV[7]) or '0')
redis.call('HDEL', KEYS[4], ARGV[7])
redis.call('ZREM', KEYS[5], ARGV[7])
give(ARGV[7], size)
return deleted
";

/// What a counter's value is counted as: the longest it can be.
const COUNTER_BYTES: usize = 20;

impl Redis {
    /// Connects (within the operation timeout) and checks the server answers.
    pub(super) async fn open(url: &str) -> Result<Self, String> {
        Ok(Redis {
            server: connect_redis(url, "grants.kv").await?,
        })
    }

    /// Runs `command` within the timeout. What Redis refuses as a value
    /// (a counter that holds no integer, an add that overflows) is the
    /// caller's `invalid-request`; anything else is the store failing.
    async fn run<T: redis::FromRedisValue>(&self, command: redis::Cmd) -> Result<T, ChainError> {
        let shown = &self.server.shown;
        self.server
            .health
            .may_try()
            .map_err(|why| unavailable("Redis", shown, why))?;
        let mut connection = self.server.connection.clone();
        let answer = tokio::time::timeout(OPERATION_TIMEOUT, command.query_async(&mut connection));
        let result = match answer.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) if refused_value(&e) => Err(ChainError::new(
                ErrorKind::InvalidRequest,
                "the key holds a value that is not a decimal integer, or the add would go past the 64-bit range",
            )),
            Ok(Err(e)) if e.code() == Some("OOM") => Err(ChainError::new(
                ErrorKind::LimitExceeded,
                "the key store (Redis) is full: it is past its maxmemory",
            )),
            Ok(Err(e)) => Err(unavailable("Redis", shown, e)),
            Err(_) => Err(unavailable(
                "Redis",
                shown,
                format!("no answer within {OPERATION_TIMEOUT:?}"),
            )),
        };
        self.server.answered(result)
    }

    /// The script `script` (after [`ACCOUNT`]) on `name` of `namespace`
    /// for `owner`, its arguments `value`, `ttl`, `version` (empty: none)
    /// and the entry's `size`.
    fn script(
        script: &str,
        (namespace, owner): (&str, Option<&str>),
        name: &str,
        (value, ttl, version, size): (&str, Option<Duration>, String, usize),
    ) -> redis::Cmd {
        let mut command = redis::cmd("EVAL");
        command.arg(format!("{ACCOUNT}{script}")).arg(7);
        for key in keys(namespace, name) {
            command.arg(key);
        }
        let space = format!("{}:{namespace}", namespace.len());
        command
            .arg(value)
            .arg(millis(ttl))
            .arg(version)
            .arg(space)
            .arg(STORED_NAMESPACE_CAP)
            .arg(size)
            .arg(name)
            .arg(owner.unwrap_or_default())
            .arg(owner_cap(STORED_NAMESPACE_CAP));
        command
    }

    fn write(
        space: (&str, Option<&str>),
        name: &str,
        value: &str,
        ttl: Option<Duration>,
        version: Option<u64>,
    ) -> redis::Cmd {
        let size = name.len() + value.len() + ENTRY_BYTES;
        let version = version.map_or_else(String::new, |v| v.to_string());
        Self::script(WRITE, space, name, (value, ttl, version, size))
    }
}

/// A script's answer: what it did, or that the namespace, or the owner's
/// part of it, is full.
enum Written<T> {
    Done(T),
    Full,
    OwnerFull,
}

impl<T: redis::FromRedisValue> redis::FromRedisValue for Written<T> {
    fn from_redis_value(value: &redis::Value) -> redis::RedisResult<Self> {
        let said = match value {
            redis::Value::BulkString(said) => Some(said.as_slice()),
            redis::Value::SimpleString(said) => Some(said.as_bytes()),
            _ => None,
        };
        match said {
            Some(b"full") => Ok(Written::Full),
            Some(b"owner-full") => Ok(Written::OwnerFull),
            _ => T::from_redis_value(value).map(Written::Done),
        }
    }
}

impl<T> Written<T> {
    fn done(self) -> Result<T, ChainError> {
        match self {
            Written::Done(done) => Ok(done),
            Written::Full => Err(full("Redis, this namespace", STORED_NAMESPACE_CAP)),
            Written::OwnerFull => Err(owner_full("Redis", owner_cap(STORED_NAMESPACE_CAP))),
        }
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
        owner: Option<&str>,
        name: &str,
        value: &str,
        ttl: Option<Duration>,
    ) -> Result<u64, ChainError> {
        let written: Written<u64> = self
            .run(Self::write((namespace, owner), name, value, ttl, None))
            .await?;
        written.done()
    }

    async fn swap(
        &self,
        namespace: &str,
        owner: Option<&str>,
        name: &str,
        value: &str,
        version: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, ChainError> {
        let swap = Self::write((namespace, owner), name, value, ttl, Some(version));
        let written: Written<Option<u64>> = self.run(swap).await?;
        written.done()
    }

    async fn add(
        &self,
        namespace: &str,
        owner: Option<&str>,
        name: &str,
        delta: i64,
        ttl: Option<Duration>,
    ) -> Result<Count, ChainError> {
        let size = name.len() + COUNTER_BYTES + ENTRY_BYTES;
        let delta = delta.to_string();
        let add = Self::script(
            ADD,
            (namespace, owner),
            name,
            (&delta, ttl, String::new(), size),
        );
        let written: Written<(i64, i64)> = self.run(add).await?;
        let (value, left) = written.done()?;
        let ttl = (left > 0).then(|| Duration::from_millis(left as u64));
        Ok(Count { value, ttl })
    }

    async fn delete(&self, namespace: &str, name: &str) -> Result<bool, ChainError> {
        let delete = Self::script(
            DELETE,
            (namespace, None),
            name,
            ("", None, String::new(), 0),
        );
        let deleted: u64 = self.run(delete).await?;
        Ok(deleted > 0)
    }

    async fn take(
        &self,
        namespace: &str,
        owner: Option<&str>,
        windows: &[Window],
    ) -> Result<Taken, ChainError> {
        self.take_windows(namespace, owner, windows).await
    }

    async fn settle(
        &self,
        namespace: &str,
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, ChainError> {
        self.settle_window(namespace, key, period, ends_ms, delta)
            .await
    }
}
