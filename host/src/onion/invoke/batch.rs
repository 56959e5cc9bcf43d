//! Concurrent and serial tool batches of an invoke: each call sees the
//! private contexts and the shared context as they were when the batch
//! started, and their writes are folded in call order when it ends.

use std::sync::{Arc, Mutex, PoisonError};

use super::Invoke;
use crate::context::Context;
use crate::onion::{Fctx, Next};
use crate::types::{ChainError, ToolRequest, ToolResponse};

impl Invoke {
    /// Runs a batch of tool calls through the tool chain concurrently,
    /// results in call order. Every call's filters see the private contexts
    /// as they were when the batch started; their writes are folded in at
    /// the end in call order, so the last writer by call index wins.
    /// The tools' writes to the shared context are folded the same way:
    /// see [`Context`].
    pub async fn tool_batch(
        self: &Arc<Self>,
        requests: Vec<ToolRequest>,
    ) -> Vec<Result<ToolResponse, ChainError>> {
        let base = self.states().clone();
        let branches: Vec<Arc<Branch>> = requests
            .iter()
            .map(|_| Arc::new(Branch::new(base.clone())))
            .collect();
        let views: Vec<Context> = requests.iter().map(|_| self.context.view()).collect();
        let calls =
            requests
                .into_iter()
                .zip(&branches)
                .zip(&views)
                .map(|((request, branch), view)| {
                    Next::start(self.onion.tool.clone(), self.clone())
                        .in_branch(branch.clone())
                        .writing_to(view.clone())
                        .call(request)
                });
        let mut batch = Batch {
            invoke: self,
            branches: &branches,
            finished: false,
        };
        let results = futures::future::join_all(calls).await;
        batch.finished = true;
        drop(batch);
        self.fold_writes(&views, &results);
        results
    }

    /// Runs tool calls one after another, each seeing the shared context as
    /// it was before the first (the filters' private contexts go on from
    /// call to call); the tools' writes are folded as in
    /// [`Invoke::tool_batch`].
    pub(crate) async fn tool_series(
        self: &Arc<Self>,
        requests: Vec<ToolRequest>,
    ) -> Vec<Result<ToolResponse, ChainError>> {
        let views: Vec<Context> = requests.iter().map(|_| self.context.view()).collect();
        let mut results = Vec::with_capacity(requests.len());
        for (request, view) in requests.into_iter().zip(&views) {
            let call = Next::start(self.onion.tool.clone(), self.clone()).writing_to(view.clone());
            results.push(call.call(request).await);
        }
        self.fold_writes(&views, &results);
        results
    }

    /// Applies the writes of the calls that succeeded, in call order,
    /// through the kernel's reducers.
    fn fold_writes<T>(&self, views: &[Context], results: &[Result<T, ChainError>]) {
        let succeeded = views
            .iter()
            .zip(results)
            .enumerate()
            .filter(|(_, (_, result))| result.is_ok())
            .map(|(index, (view, _))| (index, view));
        let conflicts = self.context.apply_writes(succeeded, &self.onion.reducers);
        if !conflicts.is_empty() {
            tracing::debug!(
                ?conflicts,
                "tool calls of one batch wrote the same keys; the last by call index won"
            );
        }
    }
}

/// A concurrent tool batch while it runs. When it ends, its calls' FCtx
/// writes are folded in call order, so the last writer by call index wins;
/// a batch cancelled midway (a deadline) keeps none of them. Either way
/// the charges of its calls' writes are given back.
struct Batch<'a> {
    invoke: &'a Invoke,
    branches: &'a [Arc<Branch>],
    finished: bool,
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        let filters = self.invoke.onion.filters.len();
        // Per filter: the bytes its calls' writes were charged, and the
        // weight of the write that wins.
        let mut released = vec![0; filters];
        let mut folded = vec![None; filters];
        let mut states = self.invoke.states();
        for branch in self.branches {
            let writes = branch.writes.lock().unwrap_or_else(PoisonError::into_inner);
            for (id, write) in writes.iter().enumerate() {
                if let Some(fctx) = write {
                    released[id] += fctx.len();
                    if self.finished {
                        states[id] = Some(fctx.clone());
                        folded[id] = Some(fctx.len());
                    }
                }
            }
        }
        drop(states);
        let mut ledger = self.invoke.ledger();
        for (id, kept) in folded.into_iter().enumerate() {
            ledger.held[id] -= released[id];
            if let Some(kept) = kept {
                ledger.held[id] = ledger.held[id] - ledger.fctx[id] + kept;
                ledger.fctx[id] = kept;
            }
        }
    }
}

/// The private contexts one call of a concurrent tool batch sees: the
/// states at the start of the batch, and the call's own writes.
pub(crate) struct Branch {
    base: Vec<Option<Fctx>>,
    writes: Mutex<Vec<Option<Fctx>>>,
}

impl Branch {
    fn new(base: Vec<Option<Fctx>>) -> Self {
        let writes = Mutex::new(vec![None; base.len()]);
        Branch { base, writes }
    }

    pub(super) fn get(&self, id: usize) -> Option<Fctx> {
        let writes = self.writes.lock().unwrap_or_else(PoisonError::into_inner);
        writes[id].clone().or_else(|| self.base[id].clone())
    }

    /// The weight of filter `id`'s write in this call, 0 without one.
    pub(super) fn written(&self, id: usize) -> usize {
        let writes = self.writes.lock().unwrap_or_else(PoisonError::into_inner);
        writes[id].as_ref().map_or(0, |fctx| fctx.len())
    }

    /// Records filter `id`'s write in this call.
    pub(super) fn set(&self, id: usize, fctx: Fctx) {
        self.writes.lock().unwrap_or_else(PoisonError::into_inner)[id] = Some(fctx);
    }
}
