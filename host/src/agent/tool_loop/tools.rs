//! One round's tool calls: their specs looked up, run through the tool
//! chain as a batch (concurrent unless configured otherwise), under the
//! batch's deadline, outputs in call order.

use std::collections::HashMap;
use std::sync::Arc;

use super::{ToolLoop, spec_of};
use crate::onion::Invoke;
use crate::types::{ChainError, ErrorKind, Origin, ToolCall, ToolRequest, ToolSpec};

impl ToolLoop {
    /// Runs a batch of tool calls through the tool chain: concurrently
    /// unless configured otherwise or a tool in it is `serial`. Outputs in
    /// call order. A tool that is not registered but was offered to the
    /// model (a chat filter added it, as `tool-search` adds its search
    /// tool) goes through the tool chain for a filter to serve, the
    /// registry answering `not-found` if none does; a call of a tool
    /// neither registered nor offered fails without running filters.
    pub(super) async fn run_tools(
        &self,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        calls: &[ToolCall],
    ) -> Vec<Result<String, ChainError>> {
        // Each name is looked up once a batch: an offered spec is copied
        // out of the request, and a batch may call one tool many times.
        let mut specs: HashMap<&str, Option<Arc<ToolSpec>>> = HashMap::new();
        let requests: Vec<Result<ToolRequest, ChainError>> = calls
            .iter()
            .map(|call| {
                let spec = specs.entry(call.name.as_str()).or_insert_with(|| {
                    spec_of(tools, &call.name)
                        .cloned()
                        .or_else(|| invoke.offered(&call.name))
                        .map(|spec| self.bounded(spec))
                });
                match spec.clone() {
                    Some(tool) => Ok(ToolRequest {
                        tool,
                        call_id: Arc::from(call.id.as_str()),
                        arguments: Arc::from(call.arguments.as_str()),
                    }),
                    None => Err(ChainError::new(
                        ErrorKind::NotFound,
                        format!("tool '{}' is not registered", call.name),
                    )),
                }
            })
            .collect();
        let serial = !self.config.parallel_tools
            || requests.iter().flatten().any(|request| request.tool.serial);
        let runnable: Vec<ToolRequest> = requests.iter().flatten().cloned().collect();
        let count = runnable.len();
        let batch = async {
            if serial || count < 2 {
                invoke.tool_series(runnable).await
            } else {
                invoke.tool_batch(runnable).await
            }
        };
        let outputs = match self.config.batch_timeout {
            None => batch.await,
            Some(limit) => tokio::time::timeout(limit, batch)
                .await
                .unwrap_or_else(|_| {
                    let ms = limit.as_millis();
                    let message =
                        format!("the batch of {count} tool calls did not finish within {ms} ms");
                    let late = ChainError::new(ErrorKind::Timeout, message)
                        .at(Origin::terminal("tool-loop"));
                    vec![Err(late); count]
                }),
        };
        let mut outputs = outputs.into_iter();
        requests
            .into_iter()
            .map(|request| match request {
                Ok(_) => outputs
                    .next()
                    .expect("one output per runnable call")
                    .map(|r| r.output),
                Err(error) => Err(error),
            })
            .collect()
    }
}
