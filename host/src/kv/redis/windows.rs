//! `take` and `settle` in Redis: one script each, on Redis's clock
//! (`TIME`), so that every replica sharing the server counts one window
//! with one rule. The rules are [`crate::kv::windows`]'s, written again
//! in Lua: an aligned window's counter is `<key>:<n>`, a fixed one's is
//! the key itself with its end in the hash's `e`.

use super::{COUNTER_BYTES, ENTRY_BYTES, Redis, Written};
use crate::kv::{Period, Seen, Taken, Window};
use crate::types::ChainError;

/// What both scripts start with (after the accounting): the calendar
/// (Howard Hinnant's civil-from-days and back), where an aligned window
/// is, a counter's name in Redis, and a counter's value.
const CALENDAR: &str = r"
local DAY = 86400000
local function civil(day)
  local z = day + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400
  if month <= 2 then year = year + 1 end
  return year, month
end
local function month_start(n)
  local year, month = 1970 + math.floor(n / 12), n % 12 + 1
  if month <= 2 then year = year - 1 end
  local era = math.floor(year / 400)
  local yoe = year - era * 400
  local mp = month > 2 and month - 3 or month + 9
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + math.floor((153 * mp + 2) / 5)
  return (era * 146097 + doe - 719468) * DAY
end
local function placed(kind, width, at)
  if kind == 'month' then
    local year, month = civil(math.floor(at / DAY))
    local n = (year - 1970) * 12 + month - 1
    return n, month_start(n), month_start(n + 1)
  end
  local n = math.floor(at / width)
  return n, n * width, n * width + width
end
local function hash(name) return 'shallot:kv:' .. ARGV[4] .. ':' .. name end
local function counted(name)
  local v = redis.call('HGET', hash(name), 'v')
  if not v then return nil end
  if not string.match(v, '^-?%d+$') then error('the counter is not an integer') end
  return tonumber(v)
end
local function digits(n) return string.format('%.0f', n) end
";

/// Counts in the `ARGV[10]` windows after it (five arguments each: key,
/// kind, width, limit, amount), all or nothing, each created counter
/// `ARGV[6]` bytes beside its name. Answers whether it was admitted and,
/// for each window, what it had used, its time left and its end; or what
/// stops it.
const TAKE: &str = r"
local count = tonumber(ARGV[10])
local found, seen, admitted = {}, {}, 1
for i = 1, count do
  local at = 10 + (i - 1) * 5
  local key, kind, width, limit = ARGV[at + 1], ARGV[at + 2], tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
  local name, v, ends, expires, used
  if kind == 'fixed' then
    name = key
    v = counted(name)
    ends = now + width
    if v then
      local e = redis.call('HGET', hash(name), 'e')
      local left = redis.call('PTTL', hash(name))
      if e then ends = tonumber(e) elseif left > 0 then ends = now + left end
    end
    used = math.max(v or 0, 0)
    expires = ends
  else
    local n, start
    n, start, ends = placed(kind, width, now)
    name = key .. ':' .. digits(n)
    v = counted(name)
    used = math.max(v or 0, 0)
    if kind == 'sliding' then
      local before = math.max(counted(key .. ':' .. digits(n - 1)) or 0, 0)
      used = used + math.floor(before * (ends - now) / width)
    end
    expires = ends + (ends - start)
  end
  if used >= limit then admitted = 0 end
  found[i] = {name, v == nil, expires, kind == 'fixed', ARGV[at + 5]}
  seen[#seen + 1] = used
  seen[#seen + 1] = math.max(ends - now, 0)
  seen[#seen + 1] = ends
end
if admitted == 1 then
  local new = 0
  for i = 1, count do
    if found[i][5] ~= '0' and found[i][2] then new = new + #found[i][1] + tonumber(ARGV[6]) end
  end
  -- No key is empty: this asks for room beside every key.
  local stopped = room('', new)
  if stopped then return stopped end
  for i = 1, count do
    local name, expires, amount = found[i][1], found[i][3], found[i][5]
    if amount ~= '0' then
      local h = hash(name)
      local created = redis.call('EXISTS', h) == 0
      redis.call('HINCRBY', h, 'v', amount)
      redis.call('HSET', h, 'n', redis.call('INCR', KEYS[2]))
      if found[i][4] then redis.call('HSET', h, 'e', digits(expires)) end
      if created or redis.call('PTTL', h) < 0 then
        redis.call('PEXPIREAT', h, digits(expires))
      end
      if created then account(name, #name + tonumber(ARGV[6]), math.max(expires - now, 1)) end
    end
  end
end
local answer = {admitted}
for _, n in ipairs(seen) do answer[#answer + 1] = n end
return answer
";

/// Adds `ARGV[14]` to the counter of the window of key `ARGV[10]`, kind
/// `ARGV[11]`, width `ARGV[12]` that ends at `ARGV[13]`, never below 0:
/// the counter after, or `false` when that window's counter is gone.
const SETTLE: &str = r"
local key, kind, width, ends = ARGV[10], ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13])
local name = key
if kind == 'fixed' then
  if tonumber(redis.call('HGET', hash(name), 'e') or '-1') ~= ends then return false end
else
  local n, _, at = placed(kind, width, ends - 1)
  if at ~= ends then return false end
  name = key .. ':' .. digits(n)
end
local v = counted(name)
if not v then return false end
local h = hash(name)
local after
if v + tonumber(ARGV[14]) < 0 then
  redis.call('HSET', h, 'v', 0)
  after = 0
else
  after = redis.call('HINCRBY', h, 'v', ARGV[14])
end
redis.call('HSET', h, 'n', redis.call('INCR', KEYS[2]))
return after
";

/// How the scripts name a period: its kind and width.
fn kind(period: Period) -> (&'static str, u64) {
    match period {
        Period::Fixed(width) => ("fixed", width),
        Period::Sliding(width) => ("sliding", width),
        Period::Aligned(width) => ("aligned", width),
        Period::Month => ("month", 0),
    }
}

impl Redis {
    pub(super) async fn take_windows(
        &self,
        namespace: &str,
        owner: Option<&str>,
        windows: &[Window],
    ) -> Result<Taken, ChainError> {
        let script = format!("{CALENDAR}{TAKE}");
        let size = COUNTER_BYTES + ENTRY_BYTES;
        let mut take = Self::script(
            &script,
            (namespace, owner),
            "",
            ("", None, String::new(), size),
        );
        take.arg(windows.len());
        for window in windows {
            let (kind, width) = kind(window.period);
            take.arg(&window.key)
                .arg(kind)
                .arg(width)
                .arg(window.limit)
                .arg(window.amount);
        }
        let answer: Written<Vec<i64>> = self.run(take).await?;
        let answer = answer.done()?;
        let windows = answer[1..]
            .chunks_exact(3)
            .map(|seen| Seen {
                used: seen[0].max(0) as u64,
                reset_ms: seen[1].max(0) as u64,
                ends_ms: seen[2].max(0) as u64,
            })
            .collect();
        Ok(Taken {
            admitted: answer.first() == Some(&1),
            windows,
        })
    }

    pub(super) async fn settle_window(
        &self,
        namespace: &str,
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, ChainError> {
        let script = format!("{CALENDAR}{SETTLE}");
        let mut settle = Self::script(&script, (namespace, None), "", ("", None, String::new(), 0));
        let (kind, width) = kind(period);
        settle.arg(key).arg(kind).arg(width).arg(ends_ms).arg(delta);
        let after: Option<i64> = self.run(settle).await?;
        Ok(after.map(|after| after.max(0) as u64))
    }
}
