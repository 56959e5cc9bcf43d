//! `approval.ask` (`grants.approval`): a question to the approval handler
//! the operator or embedder installed, never elsewhere, from around hooks
//! only (a caller waits on the decision). Its arguments must be a JSON
//! object of at most [`APPROVAL_ARGUMENTS_CAP`] bytes, checked before the
//! host parses them; the tool name and reason are escaped and capped like
//! log lines; at most [`ASKS_PER_CALL`] questions a call, and the wait is
//! bounded by the filter's timeout and [`APPROVAL_WAIT_CAP_MS`] a call in
//! all, and is not the filter's own time.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;

use super::HostState;
use super::service::{AROUND, GrantedServices, Service, Spent, error};
use crate::escape;
use crate::onion::{ApprovalRequest, Approver};
use crate::plugin::bindings::shallot::filter::approval;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::types::Call;

/// Questions one call may put to the approval handler.
const ASKS_PER_CALL: u32 = 16;
/// The longest one call may wait for the approval handler in all, in ms,
/// whatever it asks for.
const APPROVAL_WAIT_CAP_MS: u32 = 10 * 60 * 1000;
/// The largest approval question's arguments (JSON text), in bytes.
const APPROVAL_ARGUMENTS_CAP: usize = 64 << 10;

/// The `approval` service: granted or not.
pub(crate) struct Approval;

/// What a call asked: questions, and the time it waited for answers.
#[derive(Default)]
pub(crate) struct Asked {
    asks: u32,
    waited: Duration,
}

impl Service for Approval {
    const IMPORT: &'static str = "approval";
    const CALLED: &'static str = "approval.ask";
    const CALLS: &'static [Call] = AROUND;
    const GRANT: &'static str = "approval = true";
    type Granted = ();
    type Spent = Asked;

    fn granted(services: &GrantedServices) -> Option<&()> {
        services.approval.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut Asked {
        &mut spent.approval
    }
}

/// What `grants.approval` opens.
pub(super) fn open(approval: bool) -> Option<()> {
    approval.then_some(())
}

impl approval::Host for HostState {
    async fn ask(
        &mut self,
        tool: String,
        arguments: String,
        reason: String,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<bool, wit::FilterError>> {
        if let Err(refused) = self.admit::<Approval>() {
            return Ok(Err(refused));
        }
        let asked = self.spent::<Approval>();
        asked.asks += 1;
        if asked.asks > ASKS_PER_CALL {
            let message = format!("more than {ASKS_PER_CALL} approval questions in one call");
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        if arguments.len() > APPROVAL_ARGUMENTS_CAP {
            let message = format!(
                "an approval question's arguments of {} bytes are over the cap of {APPROVAL_ARGUMENTS_CAP}",
                arguments.len()
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let arguments = match self.json_object(&arguments, "the arguments")? {
            Ok(map) => serde_json::Value::Object(map),
            Err(message) => return Ok(Err(error(wit::ErrorKind::InvalidRequest, message))),
        };
        let Some(scope) = &self.scope else {
            return Ok(Err(error(
                wit::ErrorKind::InvalidRequest,
                "approval.ask called outside a hook",
            )));
        };
        let Some(approver) = scope.invoke.onion().approver.clone() else {
            return Ok(Ok(false));
        };
        let request = ApprovalRequest {
            filter: self.identity.name.clone(),
            tool: escape::printable(&tool, escape::TEXT_CAP),
            arguments,
            reason: escape::printable(&reason, escape::TEXT_CAP),
            context: scope.invoke.context().clone(),
        };
        // The guest's copies (up to its memory cap) are not held through a
        // wait of up to ten minutes.
        drop((tool, reason));
        Ok(self.answer(approver, &request, timeout_ms).await)
    }
}

impl HostState {
    /// Waits for the approver's answer to `request`, at most `timeout_ms`
    /// and what is left of the call's approval wait; the wait is not the
    /// guest's CPU time.
    async fn answer(
        &mut self,
        approver: Arc<dyn Approver>,
        request: &ApprovalRequest,
        timeout_ms: u32,
    ) -> Result<bool, wit::FilterError> {
        let left = Duration::from_millis(APPROVAL_WAIT_CAP_MS.into())
            .saturating_sub(self.spent::<Approval>().waited);
        let wait = Duration::from_millis(timeout_ms.into()).min(left);
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let started = tokio::time::Instant::now();
        // A handler that panics fails the question, not the host.
        let asked = AssertUnwindSafe(approver.approve(request)).catch_unwind();
        let answer = tokio::time::timeout(wait, asked).await;
        self.spent::<Approval>().waited += started.elapsed();
        meter.leave_next();
        match answer {
            Ok(Ok(approved)) => Ok(approved),
            Ok(Err(_)) => Err(error(
                wit::ErrorKind::Internal,
                "the approval handler failed",
            )),
            Err(_) => {
                let message = format!(
                    "the approval handler did not answer within {} ms",
                    wait.as_millis()
                );
                Err(error(wit::ErrorKind::Timeout, message))
            }
        }
    }
}
