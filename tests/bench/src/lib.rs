//! What shallot's benchmarks share: a model that answers at once, the
//! native baseline layer, kernels of N pass-through layers, criterion's
//! settings, criterion's medians for the derived tables, and the record of
//! calls that failed while measured (a faulting filter is reported, not a
//! reason to stop). Each bench in `benches/` measures one cost against
//! baselines of the same run and prints its derived table after
//! criterion's report; docs/PERFORMANCE.md records them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::Criterion;
use futures::stream::{self, BoxStream, StreamExt};
use mimalloc::MiMalloc;
use serde_json::Value;
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message, TokenBatch};
use shallot::{
    ChainError, ChatModel, Context, Filter, FilterScope, Kernel, ModelEvent, TokenTransform,
};
use shallot_tests::{load, target_dir, warm};
use tokio::runtime::Runtime;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// Calls that failed while being measured, by bench: how many, and the
/// first error. A faulting filter is reported, not a reason to stop.
static FAILED: Mutex<BTreeMap<String, (u64, String)>> = Mutex::new(BTreeMap::new());

/// Records `result` of a call measured by `bench` if it failed.
pub fn survive<T, E: std::fmt::Display>(bench: &str, result: Result<T, E>) {
    if let Err(e) = result {
        let mut failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
        failed
            .entry(bench.to_owned())
            .or_insert((0, e.to_string()))
            .0 += 1;
    }
}

/// Prints the calls that failed while measured, if any.
pub fn report_failures() {
    let failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
    if !failed.is_empty() {
        println!("\n## Calls that failed while measured (their times are not a layer's cost)\n");
        println!("| bench | failed calls | first error |");
        println!("|---|---|---|");
        for (bench, (count, error)) in failed.iter() {
            println!("| {bench} | {count} | {error} |");
        }
    }
}

/// Criterion as every bench here runs it: short, and open to the command
/// line's options.
pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args()
}

pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
}

/// A model that answers at once, so a benchmark measures the filters.
#[derive(Clone)]
pub struct Instant0 {
    response: ChatResponse,
}

#[async_trait]
impl ChatModel for Instant0 {
    fn name(&self) -> &str {
        "instant"
    }

    async fn chat(&self, _: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        Ok(self.response.clone())
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let text = self.response.text();
        let tokens: Vec<Result<ModelEvent, ChainError>> = text
            .split_inclusive(' ')
            .map(|word| {
                Ok(ModelEvent::Token {
                    text: word.to_owned(),
                    meta: None,
                })
            })
            .chain([Ok(ModelEvent::Done(self.response.clone()))])
            .collect();
        Ok(stream::iter(tokens).boxed())
    }
}

pub fn model() -> Instant0 {
    model_saying("ok")
}

/// A model that answers `text` at once, streamed a word per token.
pub fn model_saying(text: &str) -> Instant0 {
    Instant0 {
        response: ChatResponse::new(Message::assistant(text), FinishReason::Complete),
    }
}

/// A conversation of about `bytes` bytes, in eight messages.
pub fn conversation(bytes: usize) -> ChatRequest {
    let chunk = "lorem ipsum ".repeat(bytes / 8 / 12 + 1);
    ChatRequest::new(
        (0..8)
            .map(|i| {
                if i % 2 == 0 {
                    Message::user(&chunk[..bytes / 8])
                } else {
                    Message::assistant(&chunk[..bytes / 8])
                }
            })
            .collect(),
    )
}

/// A native filter that passes everything through: the baseline layer.
pub struct Native(String);

#[async_trait]
impl Filter for Native {
    fn name(&self) -> &str {
        &self.0
    }

    fn hooks(&self) -> &[shallot::Hook] {
        &[shallot::Hook::AroundChat, shallot::Hook::TokenTransform]
    }

    async fn token_transform(
        &self,
        _: &FilterScope,
    ) -> Result<Option<Box<dyn TokenTransform>>, ChainError> {
        Ok(Some(Box::new(Identity)))
    }
}

pub struct Identity;

#[async_trait]
impl TokenTransform for Identity {
    async fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError> {
        Ok(tokens)
    }
}

pub fn native_kernel(layers: usize) -> Kernel {
    (0..layers)
        .fold(Kernel::builder(), |k, i| {
            k.filter(Native(format!("native-{i}")))
        })
        .model(model())
        .build()
        .unwrap()
}

/// `layers` warm instances of the test guest `guest` (`passthrough`: every
/// call hook live, passing through; `copy_tokens`: a live token transform
/// copying its tokens) before the model.
pub fn wasm_kernel(rt: &Runtime, guest: &str, layers: usize) -> Kernel {
    let specs = (0..layers)
        .map(|i| warm(guest, &format!("wasm-{i}"), Value::Null))
        .collect();
    let plugins = rt.block_on(load(specs));
    Kernel::builder()
        .plugins(&plugins)
        .model(model())
        .build()
        .unwrap()
}

pub fn time_chats(
    rt: &Runtime,
    bench: &str,
    kernel: &Kernel,
    request: &ChatRequest,
    iters: u64,
) -> Duration {
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            survive(bench, kernel.chat(request.clone(), Context::new()).await);
        }
        start.elapsed()
    })
}

/// Criterion's median estimate for `id`, in nanoseconds (the median: this
/// machine is a noisy VM); NaN for a bench this run did not measure (a
/// filter on the command line).
pub fn median(id: &str) -> f64 {
    let path: PathBuf = target_dir()
        .join("criterion")
        .join(id)
        .join("new")
        .join("estimates.json");
    std::fs::read(&path)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|json| json["median"]["point_estimate"].as_f64())
        .unwrap_or(f64::NAN)
}
