//! Benchmark guest: a live token transform that emits every token as it
//! came, written as a filter author would (not the SDK's `PassThrough`,
//! which the SDK leaves out of the descriptor). The floor of what a wasm
//! token transform costs.

use serde::Deserialize;
use shallot_guest::{Filter, FilterError, TokenOut, TokenTransform, Tokens};

#[derive(Deserialize)]
struct CopyTokens {}

#[shallot_guest::filter(name = "copy-tokens")]
impl Filter for CopyTokens {
    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Copy)
    }
}

struct Copy;

impl TokenTransform for Copy {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        out.push_all(tokens);
        Ok(())
    }
}
