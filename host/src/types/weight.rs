//! How many bytes of host memory a value holds, roughly: the sizes of its
//! strings and collections plus a fixed overhead per item. What a filter's
//! host memory cap counts (see `sandbox::Limits::host_mib`).

use serde_json::Value;

use super::{
    ChatRequest, ChatResponse, Content, ContentPart, Message, TokenBatch, ToolCall, ToolRequest,
    ToolResponse, ToolSpec, TurnDone, TurnInterrupt, TurnRequest,
};

/// Bytes counted for every item besides its text: a fair share of the
/// struct, its allocation and the collection it sits in.
const ITEM: usize = 64;

/// A value's weight in host memory.
pub(crate) trait Weigh {
    fn weight(&self) -> usize;
}

impl<T: Weigh> Weigh for [T] {
    fn weight(&self) -> usize {
        self.iter().map(Weigh::weight).sum()
    }
}

impl Weigh for Value {
    fn weight(&self) -> usize {
        ITEM + match self {
            Value::String(s) => s.len(),
            Value::Array(items) => items.iter().map(Weigh::weight).sum(),
            Value::Object(map) => map.iter().map(|(k, v)| k.len() + v.weight()).sum(),
            _ => 0,
        }
    }
}

impl Weigh for ToolCall {
    fn weight(&self) -> usize {
        ITEM + self.id.len() + self.name.len() + self.arguments.len()
    }
}

impl Weigh for Message {
    fn weight(&self) -> usize {
        let content = match &self.content {
            None => 0,
            Some(Content::Text(text)) => text.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .map(|part| {
                    ITEM + match part {
                        ContentPart::Text { text } => text.len(),
                        ContentPart::Image { url, detail } => {
                            url.len() + detail.as_ref().map_or(0, String::len)
                        }
                    }
                })
                .sum(),
        };
        ITEM + content
            + self.tool_calls.weight()
            + self.tool_call_id.as_ref().map_or(0, String::len)
    }
}

impl Weigh for ToolSpec {
    fn weight(&self) -> usize {
        ITEM + self.name.len() + self.description.len() + self.parameters.weight()
    }
}

fn map_weight(map: &super::JsonMap) -> usize {
    map.iter().map(|(k, v)| k.len() + v.weight()).sum()
}

impl Weigh for ChatRequest {
    fn weight(&self) -> usize {
        ITEM + self.messages.weight() + self.tools.weight() + map_weight(&self.options)
    }
}

impl Weigh for ChatResponse {
    fn weight(&self) -> usize {
        ITEM + self.message.weight() + self.model.len() + map_weight(&self.metadata)
    }
}

impl Weigh for ToolRequest {
    fn weight(&self) -> usize {
        ITEM + self.tool.weight() + self.call_id.len() + self.arguments.len()
    }
}

impl Weigh for ToolResponse {
    fn weight(&self) -> usize {
        ITEM + self.output.len()
    }
}

impl Weigh for TurnRequest {
    fn weight(&self) -> usize {
        ITEM + self.messages.weight()
    }
}

impl Weigh for TurnDone {
    fn weight(&self) -> usize {
        let calls: usize = self
            .tool_calls
            .iter()
            .map(|record| {
                record.call.weight()
                    + record.output.as_ref().map_or(0, String::len)
                    + record.error.as_ref().map_or(0, |e| e.message.len())
            })
            .sum();
        ITEM + self.response.weight() + calls + self.messages.weight()
    }
}

impl Weigh for TurnInterrupt {
    fn weight(&self) -> usize {
        ITEM + self.reason.len() + self.pending.as_ref().map_or(0, Weigh::weight)
    }
}

impl Weigh for TokenBatch {
    fn weight(&self) -> usize {
        self.text.len()
            + self.ends.len() * 4
            + self
                .metas
                .iter()
                .map(|(_, m)| ITEM + m.len())
                .sum::<usize>()
    }
}
