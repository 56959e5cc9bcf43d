//! A client's Responses request as it comes in: its input items, tools and
//! tool choice as typed structs read straight from the body, then put in
//! our terms. An item's `type` may be left out for a message, so an item
//! is one struct whose fields each kind checks for itself.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::wire::{TextOr, function_tool};
use crate::types::{Content, ContentPart, Message, Role, ToolCall, ToolChoice, ToolSpec};

/// An input item: a message (with or without `"type": "message"`), a
/// function call the model made, its output, or reasoning (left out).
#[derive(Deserialize)]
pub(super) struct Item {
    #[serde(rename = "type", default)]
    kind: Option<ItemKind>,
    #[serde(default)]
    role: Option<InRole>,
    #[serde(default)]
    content: Option<TextOr<Part>>,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    output: Option<TextOr<OutputPart>>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum ItemKind {
    Message,
    FunctionCall,
    FunctionCallOutput,
    Reasoning,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum InRole {
    User,
    System,
    Developer,
    Assistant,
}

/// A part of a message's (or reasoning's) content.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    #[serde(alias = "output_text")]
    InputText {
        text: String,
    },
    Refusal {
        refusal: String,
    },
    InputImage {
        #[serde(default)]
        image_url: Option<String>,
        #[serde(default)]
        detail: Option<String>,
    },
    /// A reasoning item's own text: not sent on.
    #[serde(alias = "summary_text")]
    ReasoningText {},
}

/// A part of a function call's output: its text is what the model reads.
#[derive(Deserialize)]
pub(super) struct OutputPart {
    #[serde(default)]
    text: Option<String>,
}

impl Item {
    /// The item added to `messages`: a `function_call` joins the assistant
    /// message before it.
    pub(super) fn into_messages(self, messages: &mut Vec<Message>) -> Result<(), String> {
        let kind = self.kind.unwrap_or(ItemKind::Message);
        let missing = |name: &str| format!("a '{}' item has no `{name}`", kind_name(kind));
        match kind {
            ItemKind::Message => {
                let role = match self.role.ok_or("a message has no `role`")? {
                    InRole::User => Role::User,
                    InRole::System | InRole::Developer => Role::System,
                    InRole::Assistant => Role::Assistant,
                };
                let content = match self.content.ok_or_else(|| missing("content"))? {
                    TextOr::Text(text) => Content::Text(text),
                    TextOr::List(parts) => Content::Parts(
                        parts
                            .into_iter()
                            .filter_map(Part::into_part)
                            .collect::<Result<_, _>>()?,
                    ),
                };
                messages.push(Message {
                    content: Some(content),
                    ..Message::new(role, "")
                });
            }
            ItemKind::FunctionCall => {
                let call = ToolCall {
                    id: self.call_id.ok_or_else(|| missing("call_id"))?,
                    name: self.name.ok_or_else(|| missing("name"))?,
                    arguments: self.arguments.ok_or_else(|| missing("arguments"))?,
                };
                match messages.last_mut() {
                    Some(last) if last.role == Role::Assistant => last.tool_calls.push(call),
                    _ => messages.push(Message {
                        role: Role::Assistant,
                        content: None,
                        tool_calls: vec![call],
                        tool_call_id: None,
                    }),
                }
            }
            ItemKind::FunctionCallOutput => {
                let output = match self.output.ok_or_else(|| missing("output"))? {
                    TextOr::Text(text) => text,
                    TextOr::List(parts) => parts.into_iter().filter_map(|p| p.text).collect(),
                };
                messages.push(Message::tool_result(
                    self.call_id.ok_or_else(|| missing("call_id"))?,
                    output,
                ));
            }
            ItemKind::Reasoning => {}
        }
        Ok(())
    }
}

fn kind_name(kind: ItemKind) -> &'static str {
    match kind {
        ItemKind::Message => "message",
        ItemKind::FunctionCall => "function_call",
        ItemKind::FunctionCallOutput => "function_call_output",
        ItemKind::Reasoning => "reasoning",
    }
}

impl Part {
    /// The part in our terms; reasoning's text is none.
    fn into_part(self) -> Option<Result<ContentPart, String>> {
        Some(Ok(match self {
            Part::InputText { text } | Part::Refusal { refusal: text } => {
                ContentPart::Text { text }
            }
            Part::InputImage { image_url, detail } => match image_url {
                Some(url) => ContentPart::Image { url, detail },
                None => return Some(Err("an image part has no `image_url`".to_owned())),
            },
            Part::ReasoningText {} => return None,
        }))
    }
}

/// A tool as the Responses API holds it, flat (`type`, `name`,
/// `parameters`, ...); kept to be echoed in the answer.
#[derive(Deserialize, Serialize, Clone)]
pub(super) struct InTool {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

impl InTool {
    pub(super) fn to_tool(&self) -> Result<ToolSpec, String> {
        if self.kind != "function" {
            return Err("only `function` tools are supported".to_owned());
        }
        let name = self.name.clone().ok_or("a tool has no `name`")?;
        let description = self.description.clone().unwrap_or_default();
        Ok(function_tool(
            name,
            description,
            self.parameters.clone(),
            self.strict,
        ))
    }
}

/// The Responses API's `tool_choice`: a word, or a function by name.
#[derive(Deserialize, Serialize, Clone)]
#[serde(
    untagged,
    expecting = "`tool_choice` must be auto, none, required or a function"
)]
pub(super) enum InChoice {
    Mode(Mode),
    Function {
        #[serde(rename = "type")]
        kind: FunctionTag,
        name: String,
    },
}

#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(super) enum Mode {
    Auto,
    None,
    Required,
}

#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(super) enum FunctionTag {
    Function,
}

impl InChoice {
    pub(super) fn to_choice(&self) -> ToolChoice {
        match self {
            InChoice::Mode(Mode::Auto) => ToolChoice::Auto,
            InChoice::Mode(Mode::None) => ToolChoice::None,
            InChoice::Mode(Mode::Required) => ToolChoice::Required,
            InChoice::Function { name, .. } => ToolChoice::Tool(name.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Item, TextOr};
    use crate::types::{Message, Role};

    fn read(input: serde_json::Value) -> Result<Vec<Message>, String> {
        let input: TextOr<Item> = serde_json::from_value(input).map_err(|e| e.to_string())?;
        let TextOr::List(items) = input else {
            panic!("a list");
        };
        let mut messages = Vec::new();
        for item in items {
            item.into_messages(&mut messages)?;
        }
        Ok(messages)
    }

    /// What an agent SDK sends back as history: its own output items as
    /// they came (ids, statuses, annotations), reasoning, calls and their
    /// outputs.
    #[test]
    fn a_history_of_output_items_reads_as_messages() {
        let messages = read(json!([
            { "role": "user", "content": "add 1 and 2" },
            { "type": "reasoning", "id": "rs_1", "summary": [{ "type": "summary_text", "text": "adding" }],
              "content": [{ "type": "reasoning_text", "text": "1 + 2" }], "encrypted_content": null },
            { "type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{ "type": "output_text", "text": "Let me add.", "annotations": [], "logprobs": [] }] },
            { "type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add",
              "arguments": "{\"a\":1,\"b\":2}", "status": "completed" },
            { "type": "function_call_output", "call_id": "c1",
              "output": [{ "type": "input_text", "text": "3" }] },
            { "role": "developer", "content": [{ "type": "input_text", "text": "be brief" }] },
        ]))
        .unwrap();
        let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::User, Role::Assistant, Role::Tool, Role::System],
            "reasoning left out, the call joined to the message before it"
        );
        assert_eq!(messages[1].text(), "Let me add.");
        assert_eq!(messages[1].tool_calls[0].id, "c1");
        assert_eq!(messages[2].text(), "3");
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("c1"));
        let unnamed = read(json!([{ "type": "message", "content": "hi" }])).unwrap_err();
        assert!(unnamed.contains("no `role`"), "{unnamed}");
        let imageless = read(
            json!([{ "role": "user", "content": [{ "type": "input_image", "file_id": "f" }] }]),
        );
        assert!(imageless.unwrap_err().contains("image_url"));
    }
}
