//! Test and benchmark guest: every hook live, every hook passing through.
//! The floor of what a wasm layer costs.

use serde::Deserialize;
use shallot_guest::Filter;

#[derive(Deserialize)]
struct PassThrough {}

#[shallot_guest::filter(name = "passthrough")]
impl Filter for PassThrough {
    fn around_chat(
        &self,
        request: &shallot_guest::ChatRequest,
        next: shallot_guest::Next,
    ) -> Result<shallot_guest::ChatResponse, shallot_guest::FilterError> {
        next.chat(request)
    }

    fn around_tool(
        &self,
        request: &shallot_guest::ToolRequest,
        next: shallot_guest::Next,
    ) -> Result<shallot_guest::ToolResponse, shallot_guest::FilterError> {
        next.tool(request)
    }

    fn around_turn(
        &self,
        request: &shallot_guest::TurnRequest,
        next: shallot_guest::Next,
    ) -> shallot_guest::TurnResult {
        next.turn(request)
    }

    fn token_transform(&self) -> Box<dyn shallot_guest::TokenTransform> {
        Box::new(shallot_guest::PassThrough)
    }
}
