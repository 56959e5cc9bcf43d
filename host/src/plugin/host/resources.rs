//! The request and response resources of the `types` interface: the host's
//! own values in the instance's table, read and changed through handles,
//! every change charged to the filter.

use std::collections::HashMap;
use std::sync::Arc;

use wasmtime::component::Resource;

use super::{HostState, json_text};
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::convert;
use crate::types::{
    ChatRequest, ChatResponse, Content, FinishReason, ModelOptions, ToolKind, ToolRequest,
    ToolResponse, ToolSpec, TurnDone, TurnInterrupt, TurnRequest, json_weight,
};

impl wit::Host for HostState {}

impl wit::HostChatRequest for HostState {
    fn new(&mut self, messages: Vec<wit::Message>) -> wasmtime::Result<Resource<ChatRequest>> {
        self.keep(ChatRequest::new(convert::from_messages(messages)))
    }

    fn messages(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<Vec<wit::Message>> {
        self.read_messages(&this)
    }

    fn message_count(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<u32> {
        self.count_messages(&this)
    }

    fn message(
        &mut self,
        this: Resource<ChatRequest>,
        index: u32,
    ) -> wasmtime::Result<Option<wit::Message>> {
        Ok(self
            .table
            .get(&this)?
            .messages
            .get(index as usize)
            .map(convert::message))
    }

    fn set_messages(
        &mut self,
        this: Resource<ChatRequest>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<()> {
        self.replace_messages(&this, messages)
    }

    fn push_message(
        &mut self,
        this: Resource<ChatRequest>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        self.append_message(&this, message)
    }

    fn insert_message(
        &mut self,
        this: Resource<ChatRequest>,
        index: u32,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        let messages = self.table.get_mut(&this)?.messages_mut();
        let index = (index as usize).min(messages.len());
        messages.insert(index, message.into());
        self.recharge(&this)?;
        Ok(())
    }

    fn tools(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<Vec<wit::ToolSpec>> {
        let tools = self.table.get(&this)?.tools.iter();
        Ok(tools.map(convert::tool_spec).collect())
    }

    fn registered_tools(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<Vec<String>> {
        let tools = &self.table.get(&this)?.tools;
        Ok(self
            .scope
            .as_ref()
            .map_or_else(Vec::new, |s| s.invoke.registered(tools)))
    }

    fn set_tools(
        &mut self,
        this: Resource<ChatRequest>,
        tools: Vec<wit::ToolSpec>,
    ) -> wasmtime::Result<Result<(), String>> {
        // The tools' parameters, parsed once they are known to fit
        // together.
        let mut weight = 0usize;
        for tool in &tools {
            let what = format!("tool '{}': parameters", tool.name);
            match json_weight(&tool.parameters) {
                Ok(one) => weight = weight.saturating_add(one),
                Err(e) => return Ok(Err(format!("{what} is not JSON: {e}"))),
            }
        }
        self.afford(weight)?;
        let mut parsed = Vec::with_capacity(tools.len());
        for tool in tools {
            match serde_json::from_str(&tool.parameters) {
                Ok(serde_json::Value::Object(parameters)) => parsed.push((tool, parameters)),
                _ => {
                    let name = &tool.name;
                    return Ok(Err(format!(
                        "tool '{name}': parameters must be a JSON object"
                    )));
                }
            }
        }
        let request = self.table.get_mut(&this)?;
        // By name, once: a guest's long list against a client's long one
        // costs the host linear time, not their product.
        let earlier: HashMap<&str, &ToolSpec> = request
            .tools
            .iter()
            .map(|tool| (tool.name.as_str(), tool))
            .collect();
        let tools = parsed
            .into_iter()
            .map(|(tool, parameters)| {
                let tool = convert::from_tool_spec(tool, parameters);
                match earlier.get(tool.name.as_str()) {
                    Some(earlier) => tool.keeping_host_side(earlier),
                    None => tool,
                }
            })
            .collect();
        request.tools = Arc::new(tools);
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn options(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<String> {
        let options = &self.table.get(&this)?.options;
        Ok(serde_json::to_string(&**options)?)
    }

    fn set_options(
        &mut self,
        this: Resource<ChatRequest>,
        options: String,
    ) -> wasmtime::Result<Result<(), String>> {
        let read = self.parse_json(&options, "options")?.and_then(|options| {
            ModelOptions::from_json(&options)
                .map_err(|e| format!("options are not model options: {e}"))
        });
        match read {
            Ok(options) => {
                self.table.get_mut(&this)?.options = Arc::new(options);
                self.recharge(&this)?;
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn drop(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostChatResponse for HostState {
    fn new(
        &mut self,
        message: wit::Message,
        finish_reason: wit::FinishReason,
    ) -> wasmtime::Result<Resource<ChatResponse>> {
        self.keep(ChatResponse::new(message.into(), finish_reason.into()))
    }

    fn message(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<wit::Message> {
        Ok(convert::message(&self.table.get(&this)?.message))
    }

    fn set_message(
        &mut self,
        this: Resource<ChatResponse>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.message = message.into();
        self.recharge(&this)?;
        Ok(())
    }

    fn text(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.text())
    }

    fn set_text(&mut self, this: Resource<ChatResponse>, text: String) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.message.content = Some(Content::Text(text));
        self.recharge(&this)?;
        Ok(())
    }

    fn finish_reason(
        &mut self,
        this: Resource<ChatResponse>,
    ) -> wasmtime::Result<wit::FinishReason> {
        Ok(convert::finish_reason(self.table.get(&this)?.finish_reason))
    }

    fn set_finish_reason(
        &mut self,
        this: Resource<ChatResponse>,
        reason: wit::FinishReason,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.finish_reason = FinishReason::from(reason);
        Ok(())
    }

    fn usage(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<wit::Usage> {
        Ok(convert::usage(self.table.get(&this)?.usage))
    }

    fn set_usage(
        &mut self,
        this: Resource<ChatResponse>,
        usage: wit::Usage,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.usage = usage.into();
        Ok(())
    }

    fn model(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.model.clone())
    }

    fn metadata(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(serde_json::Value::Object(self.table.get(&this)?.metadata.clone()).to_string())
    }

    fn set_metadata(
        &mut self,
        this: Resource<ChatResponse>,
        metadata: String,
    ) -> wasmtime::Result<Result<(), String>> {
        match self.json_object(&metadata, "metadata")? {
            Ok(map) => {
                self.table.get_mut(&this)?.metadata = map;
                self.recharge(&this)?;
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn drop(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostToolRequest for HostState {
    fn tool(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<wit::ToolSpec> {
        Ok(convert::tool_spec(&self.table.get(&this)?.tool))
    }

    fn name(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.tool.name.clone())
    }

    fn call_id(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.call_id.to_string())
    }

    fn arguments(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.arguments.to_string())
    }

    fn batch(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<Vec<wit::ToolCall>> {
        let batch = self.table.get(&this)?.batch.iter();
        Ok(batch.map(convert::tool_call).collect())
    }

    fn kind(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<wit::ToolKind> {
        Ok(match self.table.get(&this)?.kind {
            ToolKind::Call => wit::ToolKind::Call,
            ToolKind::Prompt => wit::ToolKind::Prompt,
            ToolKind::Resource => wit::ToolKind::Resource,
        })
    }

    fn set_arguments(
        &mut self,
        this: Resource<ToolRequest>,
        arguments: String,
    ) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = self.json_object(&arguments, "arguments")? {
            return Ok(Err(e));
        }
        self.table.get_mut(&this)?.arguments = Arc::from(arguments);
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn drop(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostToolResponse for HostState {
    fn new(&mut self, output: String) -> wasmtime::Result<Resource<ToolResponse>> {
        json_text(&output, "tool-response output").map_err(wasmtime::Error::msg)?;
        self.keep(ToolResponse { output })
    }

    fn output(&mut self, this: Resource<ToolResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.output.clone())
    }

    fn set_output(
        &mut self,
        this: Resource<ToolResponse>,
        output: String,
    ) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = json_text(&output, "output") {
            return Ok(Err(e));
        }
        self.table.get_mut(&this)?.output = output;
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn drop(&mut self, this: Resource<ToolResponse>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnRequest for HostState {
    fn new(&mut self, messages: Vec<wit::Message>) -> wasmtime::Result<Resource<TurnRequest>> {
        self.keep(TurnRequest::new(convert::from_messages(messages)))
    }

    fn messages(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<Vec<wit::Message>> {
        self.read_messages(&this)
    }

    fn message_count(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<u32> {
        self.count_messages(&this)
    }

    fn set_messages(
        &mut self,
        this: Resource<TurnRequest>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<()> {
        self.replace_messages(&this, messages)
    }

    fn push_message(
        &mut self,
        this: Resource<TurnRequest>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        self.append_message(&this, message)
    }

    fn resume(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&this)?.resume)
    }

    fn set_resume(&mut self, this: Resource<TurnRequest>, resume: bool) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.resume = resume;
        Ok(())
    }

    fn load_history(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&this)?.load_history)
    }

    fn set_load_history(
        &mut self,
        this: Resource<TurnRequest>,
        load_history: bool,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.load_history = load_history;
        Ok(())
    }

    fn drop(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnDone for HostState {
    fn new(
        &mut self,
        response: Resource<ChatResponse>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<Resource<TurnDone>> {
        let response = self.take(response)?;
        let done = TurnDone {
            response,
            tool_calls: Vec::new(),
            iterations: 0,
            messages: Arc::new(convert::from_messages(messages)),
        };
        self.keep(done)
    }

    fn response(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<Resource<ChatResponse>> {
        let response = self.table.get(&this)?.response.clone();
        self.keep(response)
    }

    fn tool_calls(
        &mut self,
        this: Resource<TurnDone>,
    ) -> wasmtime::Result<Vec<wit::ToolCallRecord>> {
        let calls = self.table.get(&this)?.tool_calls.iter();
        Ok(calls.map(convert::tool_call_record).collect())
    }

    fn iterations(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.iterations)
    }

    fn messages(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<Vec<wit::Message>> {
        Ok(convert::messages(&self.table.get(&this)?.messages))
    }

    fn message_count(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.messages.len() as u32)
    }

    fn drop(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnInterrupt for HostState {
    fn reason(&mut self, this: Resource<TurnInterrupt>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.reason.clone())
    }

    fn pending(
        &mut self,
        this: Resource<TurnInterrupt>,
    ) -> wasmtime::Result<Option<wit::ToolCall>> {
        let pending = self.table.get(&this)?.pending.as_ref();
        Ok(pending.map(convert::tool_call))
    }

    fn drop(&mut self, this: Resource<TurnInterrupt>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}
