//! Test guest: a filter that breaks on purpose (trap, panic, endless loop,
//! memory bomb, error) at one chosen point, and otherwise passes through.

use serde::Deserialize;
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Fctx, Filter, FilterError, TokenOut, TokenTransform,
    Tokens, ToolRequest, ToolResponse, TurnRequest, TurnResult, next,
};

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Misbehave {
    /// Where: configure, chat, tool, turn, step or flush.
    on: String,
    /// What: trap, panic, loop, oom or error.
    #[serde(rename = "do")]
    action: String,
    /// Only when the last message (or the token) contains this text.
    when: Option<String>,
}

impl Misbehave {
    fn strike(&self, at: &str, text: &str) -> Result<(), FilterError> {
        if self.on != at || self.when.as_deref().is_some_and(|w| !text.contains(w)) {
            return Ok(());
        }
        match self.action.as_str() {
            "trap" => std::process::abort(),
            "panic" => panic!("misbehave: panic in {at}"),
            "loop" => {
                let mut n = 0u64;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "oom" => {
                // Grow memory without touching it, so the cap trips long
                // before the CPU budget could, however loaded the machine.
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(std::hint::black_box(Vec::with_capacity(1 << 20)));
                }
            }
            _ => Err(FilterError::new(
                ErrorKind::Transient,
                format!("misbehave: error in {at}"),
            )),
        }
    }
}

fn last_text(messages: Vec<shallot_guest::Message>) -> String {
    messages.last().map(|m| m.text()).unwrap_or_default()
}

#[shallot_guest::filter(name = "misbehave")]
impl Filter for Misbehave {
    fn configure(&mut self) -> Result<(), String> {
        self.strike("configure", "").map_err(|e| e.message)
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        _: &Fctx<()>,
    ) -> Result<ChatResponse, FilterError> {
        self.strike("chat", &last_text(request.messages()))?;
        next::chat(request)
    }

    fn around_tool(
        &self,
        request: &ToolRequest,
        _: &Fctx<()>,
    ) -> Result<ToolResponse, FilterError> {
        self.strike("tool", &request.arguments())?;
        next::tool(request)
    }

    fn around_turn(&self, request: &TurnRequest, _: &Fctx<()>) -> TurnResult {
        if let Err(error) = self.strike("turn", &last_text(request.messages())) {
            return TurnResult::Error(error);
        }
        next::turn(request)
    }

    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(self.clone())
    }
}

impl TokenTransform for Misbehave {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        self.strike("step", tokens.text())?;
        out.push_all(tokens);
        Ok(())
    }

    fn flush(&mut self, _out: &mut TokenOut) -> Result<(), FilterError> {
        self.strike("flush", "")
    }
}
