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
        _: &shallot_guest::Fctx<()>,
    ) -> Result<shallot_guest::ChatResponse, shallot_guest::FilterError> {
        shallot_guest::next::chat(request)
    }

    fn around_tool(
        &self,
        request: &shallot_guest::ToolRequest,
        _: &shallot_guest::Fctx<()>,
    ) -> Result<shallot_guest::ToolResponse, shallot_guest::FilterError> {
        shallot_guest::next::tool(request)
    }

    fn around_turn(
        &self,
        request: &shallot_guest::TurnRequest,
        _: &shallot_guest::Fctx<()>,
    ) -> shallot_guest::TurnResult {
        shallot_guest::next::turn(request)
    }

    fn token_transform(&self) -> Box<dyn shallot_guest::TokenTransform> {
        Box::new(shallot_guest::PassThrough)
    }
}
