//! Cancelling an invoke from outside, so that it ends rather than being
//! dropped midway.

use tokio::sync::watch;

use crate::types::ChainError;

/// Cancels the invokes it is given to ([`InvokeOptions::cancel_on`]):
/// once [`cancel`](Self::cancel)led, every model call and tool call they
/// are making or go on to make ends at once with the reason's error, so
/// the filters around them see their calls end and return (`trace`
/// writes its line, a paused FCtx is kept) instead of being dropped with
/// the future. A filter's own work is not interrupted: a caller that
/// cannot wait gives it a grace and then drops the invoke (the gateway
/// gives two seconds). The shared context's [`CANCELLED`](crate::CANCELLED) key says why.
/// Clones share one state.
///
/// [`InvokeOptions::cancel_on`]: super::InvokeOptions::cancel_on
#[derive(Clone, Debug)]
pub struct Cancel {
    reason: watch::Sender<Option<ChainError>>,
}

impl Default for Cancel {
    fn default() -> Self {
        Cancel {
            reason: watch::Sender::new(None),
        }
    }
}

impl Cancel {
    /// A signal not yet given.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels, with the error the calls end in (its message is what the
    /// [`CANCELLED`](crate::CANCELLED) key says). The first reason given stays.
    pub fn cancel(&self, reason: ChainError) {
        self.reason.send_if_modified(|held| {
            let first = held.is_none();
            if first {
                *held = Some(reason);
            }
            first
        });
    }

    /// Why it was cancelled, if it was.
    pub fn reason(&self) -> Option<ChainError> {
        self.reason.borrow().clone()
    }

    /// Waits until it is cancelled, and says why.
    pub async fn cancelled(&self) -> ChainError {
        let mut reason = self.reason.subscribe();
        let held = reason.wait_for(Option::is_some).await;
        // The sender is `self`'s, so it outlives the wait.
        held.ok().and_then(|held| held.clone()).expect("a reason")
    }
}

/// The key's value for `reason`.
pub(crate) fn said(reason: &ChainError) -> serde_json::Value {
    serde_json::Value::String(reason.message.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ErrorKind;

    #[tokio::test]
    async fn the_first_reason_stays_and_wakes_every_waiter() {
        let cancel = Cancel::new();
        assert!(cancel.reason().is_none());
        let waiter = tokio::spawn({
            let cancel = cancel.clone();
            async move { cancel.cancelled().await }
        });
        cancel.cancel(ChainError::new(ErrorKind::Timeout, "late"));
        cancel.cancel(ChainError::new(ErrorKind::Transient, "gone"));
        assert_eq!(waiter.await.unwrap().message, "late");
        assert_eq!(cancel.cancelled().await.message, "late");
        assert_eq!(said(&cancel.reason().unwrap()), serde_json::json!("late"));
    }
}
