//! How many bytes of host memory a value holds, roughly: the sizes of its
//! strings and collections plus a fixed overhead per item. What a filter's
//! host memory cap counts (see `sandbox::Limits::host_mib`).

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{
    ChatRequest, ChatResponse, Content, ContentPart, Message, ModelOptions, Stop, TokenBatch,
    ToolCall, ToolChoice, ToolRequest, ToolResponse, ToolSpec, TurnDone, TurnInterrupt,
    TurnRequest,
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
        ITEM + self.messages.weight() + self.tools.weight() + self.options.weight()
    }
}

impl Weigh for ModelOptions {
    fn weight(&self) -> usize {
        let texts = [&self.model, &self.user]
            .into_iter()
            .flatten()
            .map(String::len)
            .sum::<usize>();
        let stops = self.stop.iter().flat_map(Stop::texts).map(String::len);
        let chosen = match &self.tool_choice {
            Some(ToolChoice::Tool(name)) => name.len(),
            _ => 0,
        };
        ITEM + texts
            + stops.sum::<usize>()
            + chosen
            + self.response_format.as_ref().map_or(0, Weigh::weight)
            + map_weight(&self.extra)
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

/// What JSON `text` would take in the host once parsed, at most, found by
/// walking it without building anything; an error if it is not JSON. The
/// same model as [`Weigh`] for a parsed value, at its most: a value is
/// charged before the host builds it.
pub(crate) fn json_weight(text: &str) -> serde_json::Result<usize> {
    let mut weight = Weight(text.len());
    let mut walk = serde_json::Deserializer::from_str(text);
    (&mut weight)
        .deserialize(&mut walk)
        .and_then(|()| walk.end())?;
    Ok(weight.0)
}

/// What one JSON value may take in the host, at most: a `Value` (32
/// bytes), or a map entry with its key's `String` and the map's share.
const VALUE_BYTES: usize = 96;
/// What a map takes besides its entries: its first tree node.
const MAP_BYTES: usize = 640;

/// Adds up what the values of a JSON document would take, as it reads
/// them, building none.
struct Weight(usize);

impl Weight {
    fn add(&mut self, bytes: usize) {
        self.0 = self.0.saturating_add(bytes);
    }
}

impl<'de> DeserializeSeed<'de> for &mut Weight {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for &mut Weight {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.add(VALUE_BYTES);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.add(VALUE_BYTES);
        while seq.next_element_seed(&mut *self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.add(VALUE_BYTES);
        let mut first = true;
        while map.next_key_seed(&mut *self)?.is_some() {
            if std::mem::take(&mut first) {
                self.add(MAP_BYTES);
            }
            map.next_value_seed(&mut *self)?;
        }
        Ok(())
    }
}
