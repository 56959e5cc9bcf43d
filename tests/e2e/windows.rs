//! `take` and `settle`, the key store's windows, in every store through
//! the public host API: all or nothing, a sliding window's weight, the
//! calendar month, and a settle that reaches only the window its take
//! counted in.

use shallot::{ErrorKind, Period, Window, open_kv};
use shallot_tests::RedisServer;

const HOUR_MS: u64 = 3_600_000;

fn window(key: &str, period: Period, limit: u64, amount: u64) -> Window {
    Window {
        key: key.into(),
        period,
        limit,
        amount,
    }
}

#[tokio::test]
async fn a_take_counts_in_every_window_or_in_none() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("windows-all-or-nothing", &redis) {
        let kv = open_kv(store.as_str()).await.unwrap();
        let windows = [
            window("minute", Period::Fixed(60_000), 3, 1),
            window("day", Period::Aligned(24 * HOUR_MS), 2, 1),
        ];
        for n in 0..2 {
            let taken = kv.take("ns", Some("ann"), &windows).await.unwrap();
            assert!(taken.admitted, "{store}: {taken:?}");
            assert_eq!(taken.windows[0].used, n, "{store}");
        }
        for _ in 0..3 {
            let refused = kv.take("ns", Some("ann"), &windows).await.unwrap();
            assert!(!refused.admitted, "{store}: the day is full");
            assert_eq!(
                refused.windows[0].used, 2,
                "{store}: the minute counts only what the day let through"
            );
            assert_eq!(refused.windows[1].used, 2, "{store}");
        }
        let day = [window("day", Period::Aligned(24 * HOUR_MS), u64::MAX, 0)];
        let seen = kv.take("ns", None, &day).await.unwrap();
        assert!(
            seen.admitted,
            "{store}: a look at a full window adds nothing"
        );
        let reset = seen.windows[0].reset_ms;
        assert!(reset > 0 && reset <= 24 * HOUR_MS, "{store}: {seen:?}");
        assert_eq!(
            seen.windows[0].ends_ms % (24 * HOUR_MS),
            0,
            "{store}: UTC days"
        );
        // The fixed window is the key itself, with its expiry.
        let minute = kv.get("ns", "minute").await.unwrap().unwrap();
        assert_eq!(minute.value, "2", "{store}");
    }
}

#[tokio::test]
async fn a_sliding_window_weighs_the_previous_windows_count_by_what_overlaps() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("windows-sliding", &redis) {
        let kv = open_kv(store.as_str()).await.unwrap();
        let look = [window("calls", Period::Sliding(HOUR_MS), u64::MAX, 0)];
        let now = kv.take("ns", None, &look).await.unwrap().windows[0];
        let previous = format!("calls:{}", now.ends_ms / HOUR_MS - 2);
        kv.set("ns", None, &previous, "1000", None).await.unwrap();
        let seen = kv.take("ns", None, &look).await.unwrap().windows[0];
        assert_eq!(
            seen.used,
            1000 * seen.reset_ms / HOUR_MS,
            "{store}: the previous hour weighs what of it is still in the last hour: {seen:?}"
        );
    }
}

#[tokio::test]
async fn a_month_is_the_calendars_on_the_stores_clock() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("windows-month", &redis) {
        let kv = open_kv(store.as_str()).await.unwrap();
        let month = [window("spent", Period::Month, 10, 4)];
        let taken = kv.take("ns", None, &month).await.unwrap();
        let seen = taken.windows[0];
        assert!(seen.reset_ms <= 31 * 24 * HOUR_MS, "{store}: {seen:?}");
        assert_eq!(
            seen.ends_ms % (24 * HOUR_MS),
            0,
            "{store}: a month ends at midnight"
        );
        let after = kv
            .settle("ns", "spent", Period::Month, seen.ends_ms, 3)
            .await
            .unwrap();
        assert_eq!(after, Some(7), "{store}");
    }
}

#[tokio::test]
async fn a_settle_reaches_only_the_window_its_take_counted_in() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("windows-settle", &redis) {
        let kv = open_kv(store.as_str()).await.unwrap();
        let minute = Period::Fixed(60_000);
        let held = [window("tokens", minute, 100, 40)];
        let first = kv.take("ns", None, &held).await.unwrap().windows[0];
        // The window ends (its counter goes), and the next one begins.
        kv.delete("ns", "tokens").await.unwrap();
        let settled = kv.settle("ns", "tokens", minute, first.ends_ms, -40).await;
        assert_eq!(
            settled.unwrap(),
            None,
            "{store}: a window that ended takes nothing"
        );
        let second = kv.take("ns", None, &held).await.unwrap().windows[0];
        if second.ends_ms != first.ends_ms {
            let late = kv.settle("ns", "tokens", minute, first.ends_ms, -40).await;
            assert_eq!(late.unwrap(), None, "{store}: never a later window");
        }
        let settled = kv.settle("ns", "tokens", minute, second.ends_ms, -25).await;
        assert_eq!(settled.unwrap(), Some(15), "{store}");
        let drained = kv
            .settle("ns", "tokens", minute, second.ends_ms, -1000)
            .await;
        assert_eq!(drained.unwrap(), Some(0), "{store}: never below 0");
    }
}

#[tokio::test]
async fn a_take_on_a_key_that_holds_no_number_is_refused_and_changes_nothing() {
    let redis = RedisServer::start();
    for store in shallot_tests::every_store("windows-text", &redis) {
        let kv = open_kv(store.as_str()).await.unwrap();
        kv.set("ns", None, "text", "ten", None).await.unwrap();
        let windows = [
            window("counted", Period::Fixed(60_000), 10, 1),
            window("text", Period::Fixed(60_000), 10, 1),
        ];
        let error = kv.take("ns", None, &windows).await.unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidRequest, "{store}: {error}");
        assert_eq!(kv.get("ns", "counted").await.unwrap(), None, "{store}");
        assert_eq!(kv.get("ns", "text").await.unwrap().unwrap().value, "ten");
        // A key is the script's argument, never its text.
        let lua = "x') redis.call('FLUSHALL') --";
        let windows = [window(lua, Period::Fixed(60_000), 10, 3)];
        let taken = kv.take("ns", None, &windows).await.unwrap();
        assert!(taken.admitted, "{store}");
        assert_eq!(
            kv.get("ns", lua).await.unwrap().unwrap().value,
            "3",
            "{store}"
        );
        assert_eq!(kv.get("ns", "text").await.unwrap().unwrap().value, "ten");
    }
}
