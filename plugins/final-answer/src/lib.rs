//! `final-answer` (token): shows the caller only the final answer of a
//! turn. The text a model streams in a round that ends in tool calls
//! ("Let me look that up...") is held back and dropped when the round ends
//! in `tool-use`; the text of a round that answers is released, in its
//! original tokens with their metadata. History and the turn's result keep
//! every round's text: only what the caller sees changes.
//!
//! The price: the caller sees a round's text only when the round ends,
//! since until then nobody knows whether it is the final one.
//!
//! Config: none (`null` or `{}`).

use serde::Deserialize;
use shallot_guest::{
    Filter, FilterError, FinishReason, HeldTokens, TokenOut, TokenTransform, Tokens,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FinalAnswer {}

#[shallot_guest::filter(name = "final-answer")]
impl Filter for FinalAnswer {
    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Round {
            tokens: HeldTokens::default(),
        })
    }
}

/// One model round's held tokens.
struct Round {
    tokens: HeldTokens,
}

impl TokenTransform for Round {
    fn step(&mut self, tokens: Tokens, _: &mut TokenOut) -> Result<(), FilterError> {
        self.tokens.hold(&tokens);
        Ok(())
    }

    fn flush(&mut self, end: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        if end != FinishReason::ToolUse {
            self.tokens.release(out);
        }
        Ok(())
    }
}
