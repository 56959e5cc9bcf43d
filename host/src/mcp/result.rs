//! What a tool's result from an MCP server becomes: the tool chain's
//! output (JSON), or a typed error.

use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::Value;

use crate::types::ErrorKind;

/// The output of `result`: its structured content if it has some, else
/// its text (the text blocks joined by newlines) as a JSON string, else
/// its content blocks as JSON. A result the server marks as an error is
/// an `invalid-request` error with its text (the model sees it, as any
/// tool's error). (Its size is the message's, which the transport bounds.)
pub(super) fn output(result: CallToolResult) -> Result<Value, (ErrorKind, String)> {
    let texts: Vec<&str> = result
        .content
        .iter()
        .filter_map(ContentBlock::as_text)
        .map(|text| text.text.as_str())
        .collect();
    if result.is_error == Some(true) {
        let message = match texts.is_empty() {
            true => "the tool failed".to_owned(),
            false => texts.join("\n"),
        };
        return Err((ErrorKind::InvalidRequest, message));
    }
    match result.structured_content {
        Some(structured) => Ok(structured),
        None if texts.len() == result.content.len() => Ok(Value::String(texts.join("\n"))),
        None => serde_json::to_value(&result.content).map_err(|e| {
            (
                ErrorKind::Internal,
                format!("the result does not serialize: {e}"),
            )
        }),
    }
}
