//! Client keys: which one a request presents.

use axum::http::{HeaderMap, StatusCode, header};

use super::routes::RouteTable;
use super::wire::ApiError;
use crate::config::ClientKey;

impl RouteTable {
    /// The key a request presents, if keys are required: `401` when it
    /// presents none or an unknown one. A key is presented as
    /// `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key`
    /// (Anthropic's).
    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<Option<&ClientKey>, ApiError> {
        Ok(self.key_index(headers)?.map(|i| &self.keys[i]))
    }

    /// The same, as the key's place in [`RouteTable::keys`].
    pub(super) fn key_index(&self, headers: &HeaderMap) -> Result<Option<usize>, ApiError> {
        if self.keys.is_empty() {
            return Ok(None);
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                // The scheme's name is case-insensitive (RFC 9110).
                let (scheme, key) = value.trim().split_once(char::is_whitespace)?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            })
            .or_else(|| {
                let key = headers.get("x-api-key")?.to_str().ok()?.trim();
                (!key.is_empty()).then_some(key)
            });
        let unauthorized = |code: Option<&str>, message: &str| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                code,
                message.to_owned(),
            )
        };
        let Some(presented) = presented else {
            return Err(unauthorized(
                None,
                "no API key: send one as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            ));
        };
        self.keys
            .iter()
            .position(|key| key.matches(presented))
            .map(Some)
            .ok_or_else(|| unauthorized(Some("invalid_api_key"), "the API key is not valid"))
    }
}
