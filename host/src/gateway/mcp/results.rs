//! What `/mcp` answers with: a tool's output as an MCP result, a failed
//! call as one marked as an error, and [`Menu`], the endpoint's "model",
//! which answers a `tools/list` with the tools that reached it.

use async_trait::async_trait;
use futures::stream::BoxStream;
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{Value, json};

use crate::context::Context;
use crate::model::{ChatModel, ModelEvent};
use crate::types::{
    ChainError, ChatRequest, ChatResponse, ErrorKind, FinishReason, Message, Origin,
};

/// The metadata key [`Menu`] answers with the names of the tools that
/// reached it.
pub(super) const MENU: &str = "mcp_menu";

/// The endpoint's "model": it answers a `tools/list`'s menu with the names
/// of the tools that reached it through the chat filters (under
/// `mcp_menu` in the metadata), and nothing else. Of those, only tools the
/// key was given are listed: a filter can take tools off, never add one.
pub(super) struct Menu;

#[async_trait]
impl ChatModel for Menu {
    fn name(&self) -> &str {
        "mcp-menu"
    }

    async fn chat(&self, request: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        let names: Vec<&str> = request.tools.iter().map(|t| t.name.as_str()).collect();
        let mut response = ChatResponse::new(Message::assistant(""), FinishReason::Complete);
        response.metadata.insert(MENU.to_owned(), json!(names));
        Ok(response)
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        Err(ChainError::new(
            ErrorKind::InvalidRequest,
            "the MCP endpoint answers menus, not streams",
        )
        .at(Origin::terminal("gateway")))
    }
}

/// A tool's output as an MCP result: a JSON string as its text, an array
/// of MCP content blocks as that content (a server's images, audio and
/// resources, as it sent them), other JSON as text and as structured
/// content (an object); an error object (a filter's refusal,
/// `{"error": {...}}`) marked as an error.
pub(super) fn result(output: String) -> CallToolResult {
    let value: Option<Value> = serde_json::from_str(&output).ok();
    match value {
        Some(Value::String(text)) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Some(Value::Array(blocks)) if !blocks.is_empty() => {
            match serde_json::from_value::<Vec<ContentBlock>>(Value::Array(blocks)) {
                Ok(content) => CallToolResult::success(content),
                Err(_) => CallToolResult::success(vec![ContentBlock::text(output)]),
            }
        }
        Some(value) if value.get("error").is_some_and(Value::is_object) => {
            CallToolResult::error(vec![ContentBlock::text(output)])
        }
        Some(value @ Value::Object(_)) => {
            let mut result = CallToolResult::success(vec![ContentBlock::text(output)]);
            result.structured_content = Some(value);
            result
        }
        _ => CallToolResult::success(vec![ContentBlock::text(output)]),
    }
}

/// A call the chain failed, as an MCP result marked as an error: what the
/// model would see as the tool's failure.
pub(super) fn failed(error: &ChainError) -> CallToolResult {
    let text = serde_json::json!({
        "error": {
            "type": "tool_error",
            "kind": error.kind.as_str(),
            "message": error.message,
        }
    });
    CallToolResult::error(vec![ContentBlock::text(text.to_string())])
}

#[cfg(test)]
mod tests {
    use rmcp::model::ContentBlock;
    use serde_json::json;

    use super::result;

    #[test]
    fn content_blocks_stay_content_and_other_arrays_stay_text() {
        let blocks = json!([
            { "type": "text", "text": "a red pixel" },
            { "type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png" },
            { "type": "resource", "resource": { "uri": "test://doc", "text": "the doc" } },
        ]);
        let typed = result(blocks.to_string());
        assert_eq!(typed.content.len(), 3);
        assert!(typed.content[1].as_image().is_some());
        assert!(typed.content[2].as_resource().is_some());
        assert_eq!(typed.structured_content, None);

        let numbers = json!([1, 2, 3]).to_string();
        let text = result(numbers.clone());
        assert_eq!(text.content, vec![ContentBlock::text(numbers)]);

        // A server's text that spells blocks is text: a text result is a
        // JSON string, never read as content.
        let spelled = json!(blocks.to_string()).to_string();
        let said = result(spelled);
        assert_eq!(said.content, vec![ContentBlock::text(blocks.to_string())]);
    }
}
