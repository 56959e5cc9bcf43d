//! Windows: `take` counts in several at once, all or nothing, on the
//! store's clock, and `settle` adds to the one a take counted in. Where a
//! window is at a moment is worked out here for the stores that run in
//! this process (in-process and SQLite, whose clock is this machine's);
//! Redis runs the same rules as a script on its own clock.

use super::{counter, sum};
use crate::types::{ChainError, ErrorKind};

/// A day, in milliseconds.
const DAY_MS: u64 = 24 * 3_600_000;

/// How a window cuts time (widths in milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// From the take that finds its counter gone; the counter is the key
    /// itself and expires with the window.
    Fixed(u64),
    /// The last this many milliseconds: the aligned window now and the
    /// previous one weighted by how much of it is still within them.
    Sliding(u64),
    /// Windows of this width from the Unix epoch.
    Aligned(u64),
    /// The calendar month, UTC.
    Month,
}

/// One counter of a take: its key, period, limit and what a take adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The filter's key; an aligned window's counter is `<key>:<n>`.
    pub key: String,
    /// How it cuts time.
    pub period: Period,
    /// A take is refused while the window has counted this much.
    pub limit: u64,
    /// What an admitted take adds.
    pub amount: u64,
}

/// A window as a take found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// What it had counted before the take (a sliding window's previous
    /// one weighted in).
    pub used: u64,
    /// Milliseconds until it ends.
    pub reset_ms: u64,
    /// When it ends, in milliseconds since the Unix epoch: its name to
    /// `settle`.
    pub ends_ms: u64,
}

/// What a take did: whether it added its amounts, and each window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    /// False when a window had counted its limit: nothing was added.
    pub admitted: bool,
    /// The windows, in the order given.
    pub windows: Vec<Seen>,
}

/// Where an aligned window is: its counter's number, start and end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placed {
    pub number: u64,
    pub start: u64,
    pub ends: u64,
}

impl Period {
    /// The aligned window `at` is in (`None` for a fixed one).
    pub(super) fn placed(self, at: u64) -> Option<Placed> {
        match self {
            Period::Fixed(_) => None,
            Period::Sliding(width) | Period::Aligned(width) => {
                let number = at / width;
                let start = number * width;
                Some(Placed {
                    number,
                    start,
                    ends: start + width,
                })
            }
            Period::Month => {
                let (year, month) = civil(at / DAY_MS);
                let number = (year - 1970) as u64 * 12 + month as u64 - 1;
                Some(Placed {
                    number,
                    start: month_start(number),
                    ends: month_start(number + 1),
                })
            }
        }
    }

    /// The aligned window that ends at `ends`, if one does.
    pub(super) fn ending(self, ends: u64) -> Option<Placed> {
        let placed = self.placed(ends.checked_sub(1)?)?;
        (placed.ends == ends).then_some(placed)
    }
}

/// The year and month (1 to 12) of `day`, days since the Unix epoch
/// (Howard Hinnant's civil-from-days).
fn civil(day: u64) -> (i64, i64) {
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month)
}

/// The first millisecond of month `number` (months since 1970-01), UTC
/// (days-from-civil).
fn month_start(number: u64) -> u64 {
    let (year, month) = (1970 + (number / 12) as i64, (number % 12) as i64 + 1);
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + (153 * mp + 2) / 5;
    (era * 146_097 + doe - 719_468) as u64 * DAY_MS
}

/// A namespace's counters, under its lock or in its transaction.
pub(super) trait Counters {
    type Error: From<ChainError>;
    /// The live value at `key` and its expiry (milliseconds since the
    /// Unix epoch; `None`: none).
    fn read(&mut self, key: &str) -> Result<Option<(String, Option<u64>)>, Self::Error>;
    /// Writes counter `value` at `key`: a live counter keeps its expiry
    /// and stays its creator's; a new one expires at `expires` (`None`:
    /// never) and is the writer's.
    fn write(&mut self, key: &str, value: i64, expires: Option<u64>) -> Result<(), Self::Error>;
    /// Whether counters created under `keys` fit the namespace and the
    /// writer's part of it (a store that rolls a refused take back says
    /// yes and refuses the write).
    fn room(&mut self, keys: &[&str]) -> Result<(), Self::Error>;
}

/// What a window's counter is now: its name, whether it is absent, its
/// end and expiry.
struct Counted {
    name: String,
    /// Whether the counter is absent (a take that adds creates it).
    absent: bool,
    ends: u64,
    expires: u64,
}

/// The counter of a live value, or an error for one that is no integer.
fn value(found: Option<(String, Option<u64>)>) -> Result<Option<(i64, Option<u64>)>, ChainError> {
    found
        .map(|(value, expires)| Ok((counter(&value)?, expires)))
        .transpose()
}

/// `window`'s counter at `now` and what the window has used.
fn count<C: Counters>(
    counters: &mut C,
    now: u64,
    window: &Window,
) -> Result<(Counted, u64), C::Error> {
    let Some(placed) = window.period.placed(now) else {
        let Period::Fixed(width) = window.period else {
            unreachable!("only a fixed window is not aligned")
        };
        let found = value(counters.read(&window.key)?)?;
        let (value, ends) = match found {
            Some((value, Some(expires))) => (value, expires),
            Some((value, None)) => (value, now + width),
            None => (0, now + width),
        };
        let counted = Counted {
            name: window.key.clone(),
            absent: found.is_none(),
            ends,
            expires: ends,
        };
        return Ok((counted, value.max(0) as u64));
    };
    let name = format!("{}:{}", window.key, placed.number);
    let found = value(counters.read(&name)?)?;
    let mut used = found.map_or(0, |(value, _)| value.max(0) as u64);
    if let Period::Sliding(width) = window.period {
        let previous = format!("{}:{}", window.key, placed.number.wrapping_sub(1));
        let before = value(counters.read(&previous)?)?.map_or(0, |(value, _)| value);
        let weight = u128::from(placed.ends - now);
        used += (before.max(0) as u128 * weight / u128::from(width)) as u64;
    }
    let counted = Counted {
        name,
        absent: found.is_none(),
        ends: placed.ends,
        expires: placed.ends + (placed.ends - placed.start),
    };
    Ok((counted, used))
}

/// Counts in `windows` at `now`, all or nothing.
pub(super) fn take<C: Counters>(
    counters: &mut C,
    now: u64,
    windows: &[Window],
) -> Result<Taken, C::Error> {
    let mut seen = Vec::with_capacity(windows.len());
    let mut counted = Vec::with_capacity(windows.len());
    for window in windows {
        let (found, used) = count(counters, now, window)?;
        seen.push(Seen {
            used,
            reset_ms: found.ends.saturating_sub(now),
            ends_ms: found.ends,
        });
        counted.push(found);
    }
    let admitted = windows.iter().zip(&seen).all(|(w, s)| s.used < w.limit);
    if admitted {
        let added: Vec<_> = windows
            .iter()
            .zip(&counted)
            .filter(|(w, _)| w.amount > 0)
            .collect();
        let created: Vec<&str> = added
            .iter()
            .filter(|(_, c)| c.absent)
            .map(|(_, c)| c.name.as_str())
            .collect();
        counters.room(&created)?;
        for (window, found) in added {
            // Read again: two windows of a take may share a counter.
            let current = value(counters.read(&found.name)?)?.map_or(0, |(value, _)| value);
            let amount = i64::try_from(window.amount).map_err(|_| too_much(window.amount))?;
            counters.write(&found.name, sum(current, amount)?, Some(found.expires))?;
        }
    }
    Ok(Taken {
        admitted,
        windows: seen,
    })
}

fn too_much(amount: u64) -> ChainError {
    ChainError::new(
        ErrorKind::InvalidRequest,
        format!("an amount of {amount} is past the 64-bit range"),
    )
}

/// Adds `delta` to the counter of `key`'s window of `period` that ends at
/// `ends`, while it lives, never below 0: the counter after, or `None`.
pub(super) fn settle<C: Counters>(
    counters: &mut C,
    key: &str,
    period: Period,
    ends: u64,
    delta: i64,
) -> Result<Option<u64>, C::Error> {
    let name = match period {
        Period::Fixed(_) => key.to_owned(),
        aligned => match aligned.ending(ends) {
            Some(placed) => format!("{key}:{}", placed.number),
            None => return Ok(None),
        },
    };
    let Some((current, expires)) = value(counters.read(&name)?)? else {
        return Ok(None);
    };
    if matches!(period, Period::Fixed(_)) && expires != Some(ends) {
        // The key's window is a later one.
        return Ok(None);
    }
    let after = current.saturating_add(delta).max(0);
    counters.write(&name, after, expires)?;
    Ok(Some(after as u64))
}

#[cfg(test)]
mod tests {
    use super::{DAY_MS, Period, month_start};

    #[test]
    fn months_are_the_calendars() {
        // 2026-12-07 is in month 683 (months since 1970-01), which began
        // on 2026-12-01 and ends on 2027-01-01.
        let at = 1_796_083_200_000 + 6 * DAY_MS;
        let placed = Period::Month.placed(at).unwrap();
        assert_eq!(placed.number, 56 * 12 + 11);
        assert_eq!(placed.start, 1_796_083_200_000);
        assert_eq!(placed.ends, 1_798_761_600_000);
        assert_eq!(Period::Month.ending(placed.ends), Some(placed));
        assert_eq!(Period::Month.ending(placed.ends - 1), None);
        // February of a leap year has 29 days.
        let february = 2024 - 1970;
        let length = month_start(february * 12 + 2) - month_start(february * 12 + 1);
        assert_eq!(length, 29 * DAY_MS);
    }

    #[test]
    fn an_aligned_window_is_named_by_its_end() {
        let placed = Period::Aligned(60_000).placed(125_000).unwrap();
        assert_eq!(
            (placed.number, placed.start, placed.ends),
            (2, 120_000, 180_000)
        );
        assert_eq!(Period::Sliding(60_000).ending(180_000), Some(placed));
        assert_eq!(Period::Aligned(60_000).ending(170_000), None);
        assert_eq!(Period::Fixed(60_000).ending(180_000), None);
    }
}
