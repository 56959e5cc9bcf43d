//! The `model` import (`grants.model`): side calls to a model the kernel
//! names, outside the onion. Bounded per hook call in calls and tokens (a
//! request's `max_tokens` capped to what is left); the wait is not the
//! filter's own time, and the invoke's deadline bounds it.

use serde_json::json;
use wasmtime::component::Resource;

use super::HostState;
use super::granted::{Service, error, not_granted};
use crate::plugin::bindings::shallot::filter::model;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::convert;
use crate::types::{ChatRequest, ChatResponse};

impl model::Host for HostState {
    async fn complete(
        &mut self,
        request: Resource<ChatRequest>,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        let Some(grant) = self.services.model.clone() else {
            return Ok(Err(not_granted("model", "model = \"default\"")));
        };
        if let Some(refused) = self.out_of_place(Service::Model) {
            return Ok(Err(refused));
        }
        if self.quotas.model_calls >= grant.calls {
            let message = format!("more than {} model side calls in one call", grant.calls);
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let left = grant.tokens.saturating_sub(self.quotas.model_tokens);
        if left == 0 {
            let message = format!(
                "this call spent its {} tokens of model side calls",
                grant.tokens
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let Some(scope) = &self.scope else {
            return Ok(Err(error(
                wit::ErrorKind::InvalidRequest,
                "model.complete called outside a hook",
            )));
        };
        let invoke = scope.invoke.clone();
        let Some(side) = invoke.onion().side_models.get(&grant.name).cloned() else {
            let message = format!(
                "this host has no model named `{}` for side calls",
                grant.name
            );
            return Ok(Err(error(wit::ErrorKind::InvalidRequest, message)));
        };
        let mut request = self.table.get(&request)?.clone();
        let asked = request.options.get("max_tokens").and_then(|m| m.as_u64());
        let most = asked.map_or(u64::from(left), |asked| asked.min(u64::from(left)));
        request = request.with_option("max_tokens", json!(most));
        self.quotas.model_calls += 1;
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let answer = side.side_chat(request, &invoke, invoke.context()).await;
        meter.leave_next();
        match answer {
            Ok(response) => {
                let spent = response
                    .usage
                    .input_tokens
                    .saturating_add(response.usage.output_tokens);
                self.quotas.model_tokens = self.quotas.model_tokens.saturating_add(spent.max(1));
                self.hand_over(response)
            }
            Err(failure) => Ok(Err(convert::filter_error(&failure))),
        }
    }
}
