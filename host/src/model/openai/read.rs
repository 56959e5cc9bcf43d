//! A client's chat-completions messages and tools as they come in: typed
//! structs read straight from the request's body (no JSON tree between),
//! then put in our terms. What serde cannot say (a tool message needs its
//! call's id) is checked on the way.

use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

use crate::types::{Content, ContentPart, Message, Role, ToolCall, ToolSpec};

/// A message as a client sends it.
#[derive(Deserialize)]
pub(crate) struct InMessage {
    role: InRole,
    #[serde(default)]
    content: Option<TextOr<InPart>>,
    #[serde(default)]
    tool_calls: Option<Vec<InCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum InRole {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum InPart {
    Text {
        text: String,
    },
    /// An assistant's earlier refusal, sent back as history.
    Refusal {
        refusal: String,
    },
    ImageUrl {
        image_url: InImage,
    },
}

#[derive(Deserialize)]
struct InImage {
    url: String,
    #[serde(default)]
    detail: Option<String>,
}

#[derive(Deserialize)]
struct InCall {
    id: String,
    function: InCalled,
}

#[derive(Deserialize)]
struct InCalled {
    name: String,
    #[serde(default)]
    arguments: Arguments,
}

impl InMessage {
    /// The message in our terms.
    pub(crate) fn into_message(self) -> Result<Message, String> {
        let role = match self.role {
            InRole::System | InRole::Developer => Role::System,
            InRole::User => Role::User,
            InRole::Assistant => Role::Assistant,
            InRole::Tool => Role::Tool,
        };
        if role == Role::Tool && self.tool_call_id.is_none() {
            return Err("a tool message has no `tool_call_id`".to_owned());
        }
        let content = self.content.map(|content| match content {
            TextOr::Text(text) => Content::Text(text),
            TextOr::List(parts) => {
                Content::Parts(parts.into_iter().map(InPart::into_part).collect())
            }
        });
        let tool_calls = self
            .tool_calls
            .into_iter()
            .flatten()
            .map(|call| ToolCall {
                id: call.id,
                name: call.function.name,
                arguments: call.function.arguments.0,
            })
            .collect();
        Ok(Message {
            role,
            content,
            tool_calls,
            tool_call_id: self.tool_call_id,
        })
    }
}

impl InPart {
    fn into_part(self) -> ContentPart {
        match self {
            InPart::Text { text } | InPart::Refusal { refusal: text } => ContentPart::Text { text },
            InPart::ImageUrl { image_url } => ContentPart::Image {
                url: image_url.url,
                detail: image_url.detail,
            },
        }
    }
}

/// A tool as a client sends it; only `function` tools are ours to offer.
#[derive(Deserialize)]
pub(crate) struct InTool {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    function: Option<InSpec>,
}

/// A function tool's name, description, parameters' schema and
/// strictness.
#[derive(Deserialize)]
struct InSpec {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
    #[serde(default)]
    strict: Option<bool>,
}

impl InTool {
    /// The tool in our terms.
    pub(crate) fn into_tool(self) -> Result<ToolSpec, String> {
        match (self.kind.as_str(), self.function) {
            ("function", Some(spec)) => Ok(spec.into_tool()),
            ("function", None) => Err("a tool has no `function`".to_owned()),
            _ => Err("only `function` tools are supported".to_owned()),
        }
    }
}

impl InSpec {
    fn into_tool(self) -> ToolSpec {
        function_tool(
            self.name,
            self.description.unwrap_or_default(),
            self.parameters,
            self.strict,
        )
    }
}

/// A function tool in our terms: no parameters is an empty object's
/// schema, no strictness is not strict.
pub(crate) fn function_tool(
    name: String,
    description: String,
    parameters: Option<Value>,
    strict: Option<bool>,
) -> ToolSpec {
    let parameters = parameters.unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
    ToolSpec {
        strict: strict.unwrap_or(false),
        ..ToolSpec::new(name, description, parameters)
    }
}

/// A field that is a string or a list of `T` (a message's content, a
/// system prompt's blocks): an error inside the list is reported as
/// itself, not as "matched neither".
pub(crate) enum TextOr<T> {
    Text(String),
    List(Vec<T>),
}

/// Nothing: an empty list.
impl<T> Default for TextOr<T> {
    fn default() -> Self {
        TextOr::List(Vec::new())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for TextOr<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Either<T> {
            type Value = TextOr<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(text.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Self::Value, E> {
                Ok(TextOr::Text(text))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(TextOr::List(items))
            }
        }
        deserializer.deserialize_any(Either(std::marker::PhantomData))
    }
}

/// A tool call's arguments as JSON text: the string a client sends, or an
/// object some send instead, written as text; none is the empty object.
pub(crate) struct Arguments(pub(crate) String);

impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = Arguments;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("the arguments as a JSON string (or an object)")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Arguments, E> {
                Ok(Arguments(text.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Arguments, E> {
                Ok(Arguments(text))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Arguments, E> {
                Ok(Arguments::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Arguments, A::Error> {
                let object = Value::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(Arguments(object.to_string()))
            }
        }
        deserializer.deserialize_any(Text)
    }
}

impl Default for Arguments {
    fn default() -> Self {
        Arguments("{}".to_owned())
    }
}
