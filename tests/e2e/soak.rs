//! The soak: a million invokes through one warm pass-through filter in
//! each language, with the filter's guest memory and the host's resident
//! memory sampled as it goes. Host memory must stay flat, and guest memory
//! within half the filter's cap (where the host replaces a warm instance:
//! componentize-js's heap only grows). Ignored by `cargo test` (it takes
//! minutes); `scripts/soak` runs it and prints the samples.

use serde_json::json;
use shallot::{Context, Kernel};
use shallot_tests::{ask, load, resident_mib, warm};

#[tokio::test]
#[ignore = "a soak of minutes: run it with scripts/soak"]
async fn a_million_invokes_through_warm_filters_keep_memory_flat() {
    let invokes: usize = std::env::var("SHALLOT_SOAK_INVOKES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let step = (invokes / 10).max(1);
    for (language, plugin) in [
        ("rust", "probe"),
        ("python", "py_probe"),
        ("javascript", "js_probe"),
    ] {
        let plugins = load(vec![warm(plugin, language, json!({ "hooks": ["chat"] }))]).await;
        let filter = plugins.filters()[0].clone();
        // The embedded model: it keeps nothing of what it is asked.
        let kernel = Kernel::builder().plugins(&plugins).build().unwrap();
        let half_cap = (filter.limits().memory_mib / 2) as usize;
        let mut samples = Vec::new();
        for i in 1..=invokes {
            kernel
                .chat(ask("hi"), Context::new())
                .await
                .unwrap_or_else(|e| {
                    panic!("{language}: invoke {i} failed: {e}");
                });
            if i % step == 0 {
                samples.push((i, filter.guest_memory() >> 20, resident_mib().0));
            }
        }
        println!("{language}: (invokes, guest MiB, host RSS MiB) {samples:?}");
        let (_, _, rss_early) = samples[0];
        let (_, _, rss_late) = *samples.last().unwrap();
        let guest_most = samples.iter().map(|&(_, guest, _)| guest).max().unwrap();
        assert!(
            guest_most <= half_cap + 1,
            "{language}: guest memory reached {guest_most} MiB"
        );
        assert!(
            rss_late <= rss_early + 64,
            "{language}: host memory grew from {rss_early} to {rss_late} MiB"
        );
    }
}
