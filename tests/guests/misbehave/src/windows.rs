//! Abuses of `kv.take` and `kv.settle`: too many windows, a window of no
//! width, an amount past what the store counts exactly, takes until the
//! call's operations run out, and settles that try to drive a counter
//! below zero or reach a window never taken.

use shallot_guest::kv::{self, Period, Window};
use shallot_guest::{ErrorKind, FilterError};

fn window(key: &str, period: Period, amount: u64) -> Window {
    Window {
        key: key.into(),
        period,
        limit: u64::MAX,
        amount,
    }
}

/// The abuse `action` names; `None` if it names none of these.
pub fn abuse(action: &str) -> Option<Result<(), FilterError>> {
    let minute = Period::Fixed(60_000);
    Some(match action {
        "kv-take-crowd" => {
            let crowd: Vec<_> = (0..9)
                .map(|n| window(&format!("w{n}"), minute, 1))
                .collect();
            kv::take(&crowd).map(drop)
        }
        "kv-take-instant" => kv::take(&[window("w", Period::Sliding(0), 1)]).map(drop),
        "kv-take-huge" => kv::take(&[window("w", minute, (1 << 53) + 1)]).map(drop),
        "kv-take-storm" => storm(),
        "kv-settle-drain" => drain(),
        _ => return None,
    })
}

/// Takes in eight windows until refused.
fn storm() -> Result<(), FilterError> {
    let eight: Vec<_> = (0..8)
        .map(|n| window(&format!("s{n}"), Period::Fixed(60_000), 1))
        .collect();
    loop {
        kv::take(&eight)?;
    }
}

/// Takes 5, then settles far below zero and into a window never taken:
/// an error if the counter went below 0 or the other window was reached.
fn drain() -> Result<(), FilterError> {
    let day = Period::Aligned(86_400_000);
    let taken = kv::take(&[window("drained", day, 5)])?;
    let ends = taken.windows[0].ends_ms;
    let broken = |what: &str| Err(FilterError::new(ErrorKind::Internal, what.to_owned()));
    if kv::settle("drained", day, ends, i64::MIN)? != Some(0) {
        return broken("a settle drove the counter below 0");
    }
    for (forged, delta) in [(ends + 86_400_000, 100), (ends - 1, 100), (ends, 7)] {
        let other = if forged == ends {
            Period::Fixed(60_000)
        } else {
            day
        };
        if kv::settle("drained", other, forged, delta)?.is_some() {
            return broken("a settle reached a window that was never taken");
        }
    }
    let looked = kv::take(&[window("drained", day, 0)])?;
    if looked.windows[0].used != 0 {
        return broken("the counter moved");
    }
    Ok(())
}
