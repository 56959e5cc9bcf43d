//! Anthropic's Messages wire in our terms: a chat request as a Messages
//! request, a `message` as our response.

use serde_json::{Map, Value, json};

use crate::model::openai::wire::answer;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, Content, ContentPart, ErrorKind, FinishReason, Message,
    Role, ToolCall, ToolChoice, Usage,
};

/// The Messages request for `request`: its system messages as `system`,
/// its tool results as `tool_result` blocks of a user message, its
/// assistant's calls as `tool_use` blocks, and the options Anthropic takes
/// under its names (`stop` as `stop_sequences`, `tool_choice`, `user` as
/// `metadata.user_id`); the others (OpenAI's own) are left out.
pub(super) fn body(request: &ChatRequest, model: &str, max_tokens: u64, stream: bool) -> Value {
    let (system, messages) = turns(request);
    let options = &request.options;
    let mut body = json!({
        "model": options.model.as_deref().unwrap_or(model),
        "max_tokens": options.max_tokens.or(options.max_completion_tokens).unwrap_or(max_tokens),
        "messages": messages,
    });
    if let Some(system) = system {
        body["system"] = json!(system);
    }
    if !request.tools.is_empty() {
        let tools: Vec<Value> = request
            .tools
            .iter()
            .map(|t| json!({ "name": t.name, "description": t.description, "input_schema": t.parameters }))
            .collect();
        body["tools"] = Value::Array(tools);
    }
    if let Some(temperature) = options.temperature {
        body["temperature"] = json!(temperature);
    }
    if let Some(top_p) = options.top_p {
        body["top_p"] = json!(top_p);
    }
    if let Some(top_k) = options.top_k {
        body["top_k"] = json!(top_k);
    }
    if let Some(stop) = &options.stop {
        body["stop_sequences"] = json!(stop.texts());
    }
    if let Some(choice) = &options.tool_choice {
        body["tool_choice"] = tool_choice(choice);
    }
    if options.parallel_tool_calls == Some(false) && !request.tools.is_empty() {
        if body["tool_choice"].is_null() {
            body["tool_choice"] = json!({ "type": "auto" });
        }
        body["tool_choice"]["disable_parallel_tool_use"] = json!(true);
    }
    if let Some(user) = &options.user {
        body["metadata"] = json!({ "user_id": user });
    }
    if stream {
        body["stream"] = json!(true);
    }
    body
}

/// The request's system messages joined (if any), and its other messages
/// as Messages turns: consecutive messages of one role are one turn (a
/// batch's tool results must come in one user message).
fn turns(request: &ChatRequest) -> (Option<String>, Vec<Value>) {
    let system: Vec<String> = request
        .messages
        .iter()
        .filter(|m| m.role == Role::System)
        .map(Message::text)
        .collect();
    let mut messages: Vec<Value> = Vec::new();
    for message in request.messages.iter().filter(|m| m.role != Role::System) {
        let (role, blocks) = blocks(message);
        match messages.last_mut() {
            Some(last) if last["role"] == role => {
                let content = last["content"].as_array_mut().expect("blocks");
                content.extend(blocks);
            }
            _ => messages.push(json!({ "role": role, "content": blocks })),
        }
    }
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    (system, messages)
}

/// A message's role on the wire and its content blocks.
fn blocks(message: &Message) -> (&'static str, Vec<Value>) {
    if message.role == Role::Tool {
        let block = json!({
            "type": "tool_result",
            "tool_use_id": message.tool_call_id.as_deref().unwrap_or_default(),
            "content": message.text(),
        });
        return ("user", vec![block]);
    }
    let mut blocks = Vec::new();
    match &message.content {
        None => {}
        Some(Content::Text(text)) if text.is_empty() => {}
        Some(Content::Text(text)) => blocks.push(json!({ "type": "text", "text": text })),
        Some(Content::Parts(parts)) => blocks.extend(parts.iter().map(part)),
    }
    for call in &message.tool_calls {
        let input = match serde_json::from_str::<Value>(&call.arguments) {
            Ok(input @ Value::Object(_)) => input,
            _ => Value::Object(Map::new()),
        };
        blocks
            .push(json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": input }));
    }
    let role = if message.role == Role::Assistant {
        "assistant"
    } else {
        "user"
    };
    (role, blocks)
}

/// A content part as a block: an image by data URL becomes a `base64`
/// source, any other URL a `url` source.
fn part(part: &ContentPart) -> Value {
    match part {
        ContentPart::Text { text } => json!({ "type": "text", "text": text }),
        ContentPart::Image { url, .. } => {
            let source = url
                .strip_prefix("data:")
                .and_then(|rest| rest.split_once(";base64,"))
                .map_or_else(
                    || json!({ "type": "url", "url": url }),
                    |(media, data)| json!({ "type": "base64", "media_type": media, "data": data }),
                );
            json!({ "type": "image", "source": source })
        }
    }
}

/// OpenAI's `tool_choice` as Anthropic's.
fn tool_choice(choice: &ToolChoice) -> Value {
    match choice {
        ToolChoice::Auto => json!({ "type": "auto" }),
        ToolChoice::Required => json!({ "type": "any" }),
        ToolChoice::None => json!({ "type": "none" }),
        ToolChoice::Tool(name) => json!({ "type": "tool", "name": name }),
    }
}

/// Anthropic's stop reason in our terms.
pub(super) fn finish(reason: Option<&str>) -> FinishReason {
    match reason {
        Some("end_turn") => FinishReason::Complete,
        Some("tool_use") => FinishReason::ToolUse,
        Some("max_tokens" | "model_context_window_exceeded") => FinishReason::LengthLimit,
        Some("stop_sequence") => FinishReason::StopSequence,
        Some("pause_turn") => FinishReason::PauseTurn,
        Some("refusal") => FinishReason::Refusal,
        _ => FinishReason::Unknown,
    }
}

/// A usage object's counts, where they are.
pub(super) fn usage(wire: &Value, into: &mut Usage) {
    let count = |field: &str| wire[field].as_u64().map(|n| n as u32);
    if let Some(input) = count("input_tokens") {
        let cached = count("cache_read_input_tokens").unwrap_or(0)
            + count("cache_creation_input_tokens").unwrap_or(0);
        into.input_tokens = input + cached;
    }
    if let Some(output) = count("output_tokens") {
        into.output_tokens = output;
    }
    into.total_tokens = into.input_tokens + into.output_tokens;
}

/// A `message` (a whole answer) as our response.
pub(super) fn message(body: &[u8]) -> Result<ChatResponse, ChainError> {
    let message: Value = serde_json::from_slice(body).map_err(|e| unreadable(e.to_string()))?;
    if message["type"] == "error" {
        let said = message["error"]["message"]
            .as_str()
            .unwrap_or("(no message)");
        let message = format!("the model server answered with an error: {said}");
        return Err(ChainError::new(ErrorKind::Transient, message));
    }
    let Some(blocks) = message["content"].as_array() else {
        return Err(unreadable("it has no `content`".to_owned()));
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
            Some("tool_use") => calls.push(ToolCall {
                id: block["id"].as_str().unwrap_or_default().to_owned(),
                name: block["name"].as_str().unwrap_or_default().to_owned(),
                arguments: block["input"].to_string(),
            }),
            _ => {}
        }
    }
    let mut counted = Usage::default();
    usage(&message["usage"], &mut counted);
    let reason = finish(message["stop_reason"].as_str());
    let model = message["model"].as_str().unwrap_or_default().to_owned();
    Ok(answer(Some(text), calls, reason, counted, model))
}

pub(super) fn unreadable(why: String) -> ChainError {
    ChainError::new(
        ErrorKind::Transient,
        format!("the model server sent an unreadable answer: {why}"),
    )
}
