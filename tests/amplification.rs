//! Host memory a guest could multiply: JSON text it hands the host (a
//! request's options, a context value, a tool's parameters) takes many
//! times its size once parsed. Measured by the process's peak resident
//! memory, so this runs alone in its own test binary.

use serde_json::json;
use shallot::types::{ChatRequest, Message};
use shallot::{Context, ErrorKind, Kernel, Limits};
use shallot_tests::{ScriptedModel, load, resident_mib, spec};

/// 40 MiB of JSON holding 20 million values would be more than 600 MiB as
/// the host's values, and so would thirty tools' parameters of 1.3 MiB
/// each (each under the cap alone): the host walks the text first and
/// faults the filter before building any, so its peak stays near the
/// text's own size. One test, so that the two peaks are measured apart.
#[tokio::test]
async fn json_a_guest_hands_the_host_is_bounded_before_it_is_built() {
    for action in ["json-bomb", "tools-bomb"] {
        let (path, mut filter) = spec("misbehave", "bad", json!({ "on": "chat", "do": action }));
        filter.limits = Limits {
            cpu_ms: 20_000,
            wall_ms: 40_000,
            ..Limits::default()
        };
        let plugins = load(vec![(path, filter)]).await;
        let kernel = Kernel::builder()
            .plugins(&plugins)
            .model(ScriptedModel::answer("fine"))
            .build()
            .unwrap();
        // Reset the peak (Linux: `5` to clear_refs), so it is this call's.
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
        let (before, _) = resident_mib();
        let request = ChatRequest::new(vec![Message::user("hi")]);
        let error = kernel.chat(request, Context::new()).await.unwrap_err();
        let (_, peak) = resident_mib();
        assert_eq!(error.kind, ErrorKind::PluginFault, "{action}: {error}");
        assert!(error.message.contains("host memory"), "{action}: {error}");
        assert!(
            peak - before < 300,
            "{action}: the peak grew by {} MiB for about 40 MiB of text",
            peak - before
        );
    }
}
