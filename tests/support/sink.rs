//! A token sink that records every delivery.

use std::sync::{Arc, Mutex};

use shallot::TokenSink;
use shallot::types::TokenBatch;

/// A token's text and metadata.
type OwnedToken = (String, Option<String>);

/// A token sink that records every delivery.
#[derive(Clone, Default)]
pub struct Collector {
    deliveries: Arc<Mutex<Vec<Vec<OwnedToken>>>>,
}

impl TokenSink for Collector {
    fn deliver(&self, tokens: &TokenBatch) {
        let batch = tokens
            .iter()
            .map(|t| (t.text.to_owned(), t.meta.map(str::to_owned)))
            .collect();
        self.deliveries.lock().unwrap().push(batch);
    }
}

impl Collector {
    /// Every token received, in order.
    pub fn tokens(&self) -> Vec<String> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Every token with its metadata.
    pub fn tokens_with_meta(&self) -> Vec<(String, Option<String>)> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The tokens of each delivery, in order.
    pub fn deliveries(&self) -> Vec<Vec<String>> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.iter().map(|(t, _)| t.clone()).collect())
            .collect()
    }

    /// All text received.
    pub fn text(&self) -> String {
        self.tokens().concat()
    }
}
