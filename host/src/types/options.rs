use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::JsonMap;

/// What shapes the model's answer, under the names OpenAI's chat
/// completions give them; each client API's options are read into these,
/// and each model API's request written from them. An option no API here
/// names (`logprobs`, `service_tier`, a compatible server's own) is kept
/// in [`extra`](Self::extra) and passed on to OpenAI-compatible servers as
/// it came.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelOptions {
    /// The model to ask instead of the server's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The longest answer, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// The same, as OpenAI's newer models name it (reasoning included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k sampling (Anthropic's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    /// Where the answer stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// A seed, for answers that repeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Penalty for tokens already present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Penalty for tokens by how often they appear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// Which tools the model may or must call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Whether the model may call several tools at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// The answer's format (`{"type": "json_schema", ...}`), as OpenAI
    /// writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// The end user, as the client names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Every other option, by its name.
    #[serde(flatten)]
    pub extra: JsonMap,
}

impl ModelOptions {
    /// These options, each one they do not set taken from `defaults`.
    pub fn or(mut self, defaults: &ModelOptions) -> ModelOptions {
        macro_rules! fill {
            ($($field:ident),*) => {
                $(if self.$field.is_none() {
                    self.$field.clone_from(&defaults.$field);
                })*
            };
        }
        fill!(
            model,
            max_tokens,
            max_completion_tokens,
            temperature,
            top_p,
            top_k,
            stop,
            seed,
            presence_penalty,
            frequency_penalty,
            tool_choice,
            parallel_tool_calls,
            response_format,
            user
        );
        for (key, value) in &defaults.extra {
            self.extra
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
        self
    }

    /// The longest answer asked for (the smaller of `max_tokens` and
    /// `max_completion_tokens`), if any.
    pub fn longest(&self) -> Option<u64> {
        match (self.max_tokens, self.max_completion_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Options read from a JSON object; what is wrong with them names the
    /// option.
    pub fn from_json(options: &Value) -> Result<ModelOptions, String> {
        ModelOptions::deserialize(options).map_err(|error| {
            let wrong = options
                .as_object()
                .into_iter()
                .flatten()
                .find_map(|(key, value)| {
                    let alone = Value::Object(JsonMap::from_iter([(key.clone(), value.clone())]));
                    let error = ModelOptions::deserialize(&alone).err()?;
                    Some(format!("`{key}`: {error}"))
                });
            wrong.unwrap_or_else(|| error.to_string())
        })
    }
}

/// Where the answer stops: at a text, or at any of several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One text.
    One(String),
    /// Any of these.
    Any(Vec<String>),
}

impl Stop {
    /// The texts.
    pub fn texts(&self) -> &[String] {
        match self {
            Stop::One(text) => std::slice::from_ref(text),
            Stop::Any(texts) => texts,
        }
    }
}

/// Which tools the model may or must call: written as OpenAI's chat
/// completions write it (`"auto"`, `"none"`, `"required"`, or
/// `{"type": "function", "function": {"name": ...}}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "ChoiceWire")]
pub enum ToolChoice {
    /// The model chooses.
    Auto,
    /// No tool.
    None,
    /// Some tool (Anthropic's `any`).
    Required,
    /// This tool.
    Tool(String),
}

#[derive(Clone, Serialize)]
#[serde(untagged)]
enum ChoiceWire {
    Mode(Mode),
    Named {
        #[serde(rename = "type")]
        kind: Function,
        function: Named,
    },
}

#[derive(Clone, Serialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Auto,
    None,
    Required,
}

#[derive(Clone, Serialize)]
#[serde(rename_all = "lowercase")]
enum Function {
    Function,
}

#[derive(Clone, Serialize)]
struct Named {
    name: String,
}

impl TryFrom<Value> for ToolChoice {
    type Error = String;

    fn try_from(wire: Value) -> Result<Self, String> {
        let named = (wire["type"] == "function")
            .then(|| wire["function"]["name"].as_str())
            .flatten();
        match (wire.as_str(), named) {
            (Some("auto"), _) => Ok(ToolChoice::Auto),
            (Some("none"), _) => Ok(ToolChoice::None),
            (Some("required"), _) => Ok(ToolChoice::Required),
            (_, Some(name)) => Ok(ToolChoice::Tool(name.to_owned())),
            _ => Err(
                r#"must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}"#
                    .to_owned(),
            ),
        }
    }
}

impl From<ToolChoice> for ChoiceWire {
    fn from(choice: ToolChoice) -> Self {
        match choice {
            ToolChoice::Auto => ChoiceWire::Mode(Mode::Auto),
            ToolChoice::None => ChoiceWire::Mode(Mode::None),
            ToolChoice::Required => ChoiceWire::Mode(Mode::Required),
            ToolChoice::Tool(name) => ChoiceWire::Named {
                kind: Function::Function,
                function: Named { name },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn options_read_and_write_openai_names_keeping_the_others() {
        let wire = json!({
            "temperature": 0.2,
            "stop": ["\n\n"],
            "tool_choice": { "type": "function", "function": { "name": "clock" } },
            "logprobs": true,
        });
        let options: ModelOptions = serde_json::from_value(wire.clone()).unwrap();
        assert_eq!(options.temperature, Some(0.2));
        assert_eq!(options.stop, Some(Stop::Any(vec!["\n\n".into()])));
        assert_eq!(options.tool_choice, Some(ToolChoice::Tool("clock".into())));
        assert_eq!(options.extra["logprobs"], true);
        assert_eq!(serde_json::to_value(&options).unwrap(), wire);
        let nulls: ModelOptions = serde_json::from_value(json!({ "top_p": null })).unwrap();
        assert_eq!(nulls, ModelOptions::default());
    }

    #[test]
    fn an_option_of_the_wrong_shape_is_refused() {
        for bad in [
            json!({ "temperature": "hot" }),
            json!({ "tool_choice": "sometimes" }),
            json!({ "tool_choice": { "type": "function" } }),
            json!({ "max_tokens": -1 }),
            json!({ "stop": [1] }),
        ] {
            assert!(
                serde_json::from_value::<ModelOptions>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn options_left_unset_are_taken_from_the_defaults() {
        let asked = ModelOptions {
            temperature: Some(0.1),
            ..ModelOptions::default()
        };
        let mut defaults = ModelOptions {
            temperature: Some(0.9),
            model: Some("big".into()),
            ..ModelOptions::default()
        };
        defaults.extra.insert("logprobs".into(), json!(true));
        let both = asked.or(&defaults);
        assert_eq!(both.temperature, Some(0.1));
        assert_eq!(both.model.as_deref(), Some("big"));
        assert_eq!(both.extra["logprobs"], true);
    }
}
