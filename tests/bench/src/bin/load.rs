//! An open-loop load generator for the gateway benchmark
//! (`scripts/bench-gateway`): requests at a fixed rate, whatever the
//! server's pace, each timed from when it was due (so a stall shows in the
//! latencies instead of slowing the load: no coordinated omission).
//!
//! `load URL RATE SECONDS [json|sse] [MODEL]` posts a one-message chat
//! completion for MODEL (`mock` by default) to `URL` (a
//! `/v1/chat/completions` endpoint) RATE times a second for SECONDS, and
//! prints `sent ok failed p50 p90 p99 p999 max` (ms).

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, rate, seconds, rest @ ..] = args.as_slice() else {
        eprintln!("usage: load URL RATE SECONDS [json|sse] [MODEL]");
        std::process::exit(2);
    };
    let rate: u64 = rate.parse().expect("RATE is requests per second");
    let seconds: u64 = seconds.parse().expect("SECONDS is a whole number");
    let stream = rest.first().map(String::as_str) == Some("sse");
    let model = rest.get(1).map_or("mock", String::as_str);
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"What is the answer?"}}]}}"#
    );
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .expect("an HTTP client");
    let (done, mut results) = mpsc::unbounded_channel::<Option<Duration>>();
    let interval = Duration::from_nanos(1_000_000_000 / rate);
    let start = Instant::now();
    let total = rate * seconds;
    for n in 0..total {
        let due = start + interval * n as u32;
        tokio::time::sleep_until(due.into()).await;
        let (client, url, body, done) = (client.clone(), url.clone(), body.clone(), done.clone());
        tokio::spawn(async move {
            let answered = async {
                let response = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .ok()?;
                let ok = response.status().is_success();
                let text = response.text().await.ok()?;
                (ok && (!stream || text.trim_end().ends_with("data: [DONE]"))).then_some(())
            };
            let _ = done.send(answered.await.map(|()| due.elapsed()));
        });
    }
    drop(done);
    let mut latencies = Vec::with_capacity(total as usize);
    let mut failed = 0u64;
    while let Some(result) = results.recv().await {
        match result {
            Some(latency) => latencies.push(latency),
            None => failed += 1,
        }
    }
    latencies.sort();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
    };
    println!(
        "{total} {} {failed} {:.3} {:.3} {:.3} {:.3} {:.3}",
        latencies.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999),
        latencies
            .last()
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
    );
}
