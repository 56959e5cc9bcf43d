//! A request's place among those served at once, and the bounded queue
//! for one; and the memory requests may hold at once, which a request
//! takes before its body is parsed.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::OwnedSemaphorePermit;

use super::GatewayState;
use super::wire::ApiError;
use crate::types::json_weight;

impl GatewayState {
    /// Waits for a place among the requests served at once: `429` if too
    /// many already wait, `503` if the wait runs out or the gateway starts
    /// shutting down (those waiting are told at once, to retry elsewhere).
    ///
    /// Written here rather than as tower's `ConcurrencyLimitLayer` with
    /// `LoadShedLayer`, which do what this cannot be without: the first
    /// queues without bound and without a deadline, the second sheds at
    /// once; neither answers in the OpenAI error shape, counts the queue
    /// for `/metrics`, or wakes its waiters when the gateway drains.
    pub(super) async fn place(&self) -> Result<ConcurrencyPermit, ApiError> {
        let placed = |permit| {
            self.metrics.in_progress.inc();
            ConcurrencyPermit {
                _permit: permit,
                in_progress: self.metrics.in_progress.clone(),
                memory: None,
            }
        };
        let shutting_down = || {
            ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the gateway is shutting down; retry the request".to_owned(),
            )
        };
        let mut draining = self.draining.subscribe();
        if *draining.borrow() {
            return Err(shutting_down());
        }
        if let Ok(permit) = self.places.clone().try_acquire_owned() {
            return Ok(placed(permit));
        }
        let waiting = Waiting::join(self).ok_or_else(|| {
            ApiError::busy(
                StatusCode::TOO_MANY_REQUESTS,
                "queue_full",
                format!(
                    "{} requests are in progress and {} waiting; try again later",
                    self.config.max_concurrent, self.config.max_queued
                ),
            )
        })?;
        let place = tokio::select! {
            place = tokio::time::timeout(
                self.config.queue_timeout,
                self.places.clone().acquire_owned(),
            ) => place,
            _ = draining.wait_for(|draining| *draining) => return Err(shutting_down()),
        };
        drop(waiting);
        match place {
            Ok(Ok(permit)) => Ok(placed(permit)),
            _ => Err(ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "no place to serve the request within {} ms; try again later",
                    self.config.queue_timeout.as_millis()
                ),
            )),
        }
    }
}

/// A request's place among those served at once, counted until it is
/// given back.
pub(super) struct ConcurrencyPermit {
    _permit: OwnedSemaphorePermit,
    in_progress: Gauge,
    /// The memory the request holds, given back with its place.
    memory: Option<MemoryPermit>,
}

impl ConcurrencyPermit {
    /// The place, holding `memory` too until it is given back.
    pub(super) fn holding(mut self, memory: MemoryPermit) -> Self {
        self.memory = Some(memory);
        self
    }

    /// Gives back all but `bytes` of the memory it holds.
    pub(super) fn shrink_to(&mut self, bytes: usize) {
        if let Some(memory) = &mut self.memory {
            memory.shrink_to(bytes);
        }
    }
}

impl Drop for ConcurrencyPermit {
    fn drop(&mut self) {
        self.in_progress.dec();
    }
}

/// One request in the queue, counted until it leaves (served, refused or
/// dropped with its connection).
pub(super) struct Waiting<'a>(&'a GatewayState);

impl<'a> Waiting<'a> {
    pub(super) fn join(shared: &'a GatewayState) -> Option<Self> {
        let max = shared.config.max_queued;
        shared
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        shared.metrics.waiting.inc();
        Some(Waiting(shared))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.waiting.dec();
    }
}

/// What a request may hold, in KiB of the gateway's memory for requests,
/// until it is answered (or shrunk to what its chat holds).
pub(super) struct MemoryPermit(OwnedSemaphorePermit);

impl MemoryPermit {
    /// Gives back all but `bytes`.
    pub(super) fn shrink_to(&mut self, bytes: usize) {
        let keep = u32::try_from(kib(bytes)).unwrap_or(u32::MAX).max(1) as usize;
        let held = self.0.num_permits();
        if held > keep {
            drop(self.0.split(held - keep));
        }
    }
}

/// `bytes` in KiB, rounded up.
pub(super) fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024)
}

impl GatewayState {
    /// Takes what parsing `body` could build from the memory requests may
    /// hold at once (its text, and twice what its JSON values would take:
    /// the tree, and the chat made of it while the tree lives), before any
    /// of it is built: `413` for a request that needs more than all of
    /// it, `503` when too little comes free within the queue's timeout.
    pub(super) async fn memory(&self, body: &[u8]) -> Result<MemoryPermit, ApiError> {
        let values = std::str::from_utf8(body)
            .ok()
            .and_then(|text| json_weight(text).ok())
            .unwrap_or(0);
        let bytes = body.len().saturating_add(values.saturating_mul(2));
        let needed = kib(bytes);
        let most = kib(self.config.max_request_memory);
        let Some(needed) = u32::try_from(needed).ok().filter(|_| needed <= most) else {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
                format!(
                    "this request would take about {} MiB once parsed, more than the {} MiB all requests may take at once",
                    bytes >> 20,
                    self.config.max_request_memory >> 20
                ),
            ));
        };
        let taken = tokio::time::timeout(
            self.config.queue_timeout,
            self.memory.clone().acquire_many_owned(needed),
        )
        .await;
        match taken {
            Ok(Ok(permit)) => Ok(MemoryPermit(permit)),
            _ => Err(ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "no memory to parse the request within {} ms; try again later",
                    self.config.queue_timeout.as_millis()
                ),
            )),
        }
    }
}
