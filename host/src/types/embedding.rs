use serde::{Deserialize, Serialize};

use super::{ChainError, ErrorKind, JsonMap};

/// A request for embeddings, in OpenAI's shape (the one every
/// OpenAI-compatible server takes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingRequest {
    /// The model asked for.
    pub model: String,
    /// What to embed.
    pub input: EmbeddingInput,
    /// How the vectors are written (numbers unless asked otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding_format: Option<EncodingFormat>,
    /// How many numbers each vector has, where the model can choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<u32>,
    /// Who asks, as the client names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Fields a compatible server adds (e.g. `input_type`), passed on as
    /// they came.
    #[serde(flatten)]
    pub extra: JsonMap,
}

/// What an embeddings request embeds: one vector per text (or per list of
/// token ids).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One text as token ids.
    Tokens(Vec<u32>),
    /// Several texts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// How an embedding's numbers are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// JSON numbers.
    Float,
    /// The little-endian `f32`s, in base64.
    Base64,
}

impl EmbeddingRequest {
    /// A request to embed `input` with `model`.
    pub fn new(model: impl Into<String>, input: EmbeddingInput) -> Self {
        EmbeddingRequest {
            model: model.into(),
            input,
            encoding_format: None,
            dimensions: None,
            user: None,
            extra: JsonMap::new(),
        }
    }

    /// The request, or why no model could answer it: nothing to embed.
    pub fn check(self) -> Result<Self, ChainError> {
        let empty = match &self.input {
            EmbeddingInput::Text(_) => false,
            EmbeddingInput::Texts(texts) => texts.is_empty(),
            EmbeddingInput::Tokens(tokens) => tokens.is_empty(),
            EmbeddingInput::TokenLists(lists) => {
                lists.is_empty() || lists.iter().any(Vec::is_empty)
            }
        };
        if empty {
            let message = "an embeddings request has something to embed in its `input`";
            return Err(ChainError::new(ErrorKind::InvalidRequest, message));
        }
        Ok(self)
    }

    /// Whether the vectors are asked for in base64.
    pub fn base64(&self) -> bool {
        self.encoding_format == Some(EncodingFormat::Base64)
    }
}

/// The answer to an [`EmbeddingRequest`], in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingResponse {
    /// `"list"`.
    #[serde(default = "list")]
    pub object: String,
    /// One embedding per input, in the order of the inputs.
    pub data: Vec<Embedding>,
    /// The model that answered.
    #[serde(default)]
    pub model: String,
    /// Tokens read.
    #[serde(default)]
    pub usage: EmbeddingUsage,
}

fn list() -> String {
    "list".to_owned()
}

/// One input's vector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Embedding {
    /// `"embedding"`.
    #[serde(default = "embedding")]
    pub object: String,
    /// Which input it is of.
    pub index: u32,
    /// The vector.
    pub embedding: Vector,
}

fn embedding() -> String {
    "embedding".to_owned()
}

/// A vector, as numbers or in base64 ([`EncodingFormat`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Vector {
    /// JSON numbers.
    Floats(Vec<f64>),
    /// The little-endian `f32`s, in base64.
    Base64(String),
}

/// The tokens an embeddings request read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EmbeddingUsage {
    /// Tokens of the inputs.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// The same, as OpenAI counts it.
    #[serde(default)]
    pub total_tokens: u32,
}
