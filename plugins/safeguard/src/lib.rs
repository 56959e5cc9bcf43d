//! `safeguard`: a coarse word filter on the chat chain.
//!
//! Before every model call (so tool results fed back into the loop are
//! checked too) it joins the text of all messages and looks for the
//! configured words. On a hit the model is not called: the filter answers
//! itself with `failure_response` and finish reason `content-filtered`,
//! and marks the response's metadata `{"safeguard": "blocked"}`.
//!
//! It is substring matching, not content safety: spelling variants,
//! homoglyphs and words split across messages get through.
//!
//! Config: `{"words": ["bomb"], "case_sensitive": false, "failure_response": "..."}`.

use serde::Deserialize;
use shallot_guest::{ChatRequest, ChatResponse, Filter, FilterError, FinishReason, Next};

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Safeguard {
    words: Vec<String>,
    case_sensitive: bool,
    failure_response: String,
}

impl Default for Safeguard {
    fn default() -> Self {
        Safeguard {
            words: Vec::new(),
            case_sensitive: false,
            failure_response: "Sorry, I can't help with that request.".to_owned(),
        }
    }
}

impl Safeguard {
    fn blocks(&self, text: &str) -> bool {
        if self.case_sensitive {
            self.words
                .iter()
                .any(|w| !w.is_empty() && text.contains(w.as_str()))
        } else {
            let text = text.to_lowercase();
            self.words
                .iter()
                .any(|w| !w.is_empty() && text.contains(w.as_str()))
        }
    }
}

#[shallot_guest::filter(name = "safeguard")]
impl Filter for Safeguard {
    fn configure(&mut self) -> Result<(), String> {
        if !self.case_sensitive {
            for word in &mut self.words {
                *word = word.to_lowercase();
            }
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        if self.words.is_empty() {
            return next.chat(request);
        }
        let text: String = request.messages().iter().map(|m| m.text()).collect();
        if !self.blocks(&text) {
            return next.chat(request);
        }
        let response = ChatResponse::from_text(
            self.failure_response.as_str(),
            FinishReason::ContentFiltered,
        );
        response
            .set_metadata(r#"{"safeguard":"blocked"}"#)
            .map_err(FilterError::invalid)?;
        Ok(response)
    }
}
