//! Test guest for fuzzing the boundary: raw bindings (no SDK), driven by a
//! seed from its configuration, it makes random calls across the WIT with
//! forged and stale handles, random strings (control characters, invalid
//! JSON, large), random `next` calls, and returns random results,
//! including malformed token batches. The host must turn whatever it does
//! into a value or a typed fault.

use std::cell::Cell;

wit_bindgen::generate!({
    world: "filter",
    path: "../../../wit",
    generate_all,
});

use exports::shallot::filter::plugin::{Descriptor, Hook};
use exports::shallot::filter::token_filter::GuestTokenTransformer;
use shallot::filter::types::{
    ChatRequest, ChatResponse, Content, ErrorKind, FilterError, FinishReason, Message, Role,
    TokenBatch, TokenMeta, ToolRequest, ToolResponse, TurnRequest, TurnResult,
};
use shallot::filter::{context, fctx, log, next};

thread_local! {
    static STATE: Cell<u64> = const { Cell::new(1) };
    static OPS: Cell<u32> = const { Cell::new(8) };
}

/// The next pseudo-random number (xorshift64*).
fn rand() -> u64 {
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

fn below(n: u64) -> u64 {
    rand() % n
}

/// A random string: plain, hostile characters, JSON, or large.
fn text() -> String {
    match below(6) {
        0 => String::new(),
        1 => "\u{1b}[31m\0\u{202e}\r\n\u{feff}".to_owned(),
        2 => "{\"k\": [1, 2, {\"x\": null}]}".to_owned(),
        3 => "x".repeat(below(1 << 16) as usize),
        4 => (0..below(64))
            .map(|_| char::from_u32(below(0x11_0000) as u32).unwrap_or('?'))
            .collect(),
        _ => "{unterminated".to_owned(),
    }
}

fn message() -> Message {
    Message {
        role: [Role::System, Role::User, Role::Assistant, Role::Tool][below(4) as usize],
        content: (below(4) != 0).then(|| Content::Text(text())),
        tool_calls: Vec::new(),
        tool_call_id: (below(3) == 0).then(text),
    }
}

fn error() -> FilterError {
    let kinds = [
        ErrorKind::Transient,
        ErrorKind::Timeout,
        ErrorKind::ContentFiltered,
        ErrorKind::InvalidRequest,
        ErrorKind::Auth,
        ErrorKind::NotFound,
        ErrorKind::LimitExceeded,
        ErrorKind::PluginFault,
        ErrorKind::Internal,
    ];
    FilterError {
        kind: kinds[below(kinds.len() as u64) as usize],
        message: text(),
    }
}

/// A handle number that may or may not name something in the host's table.
fn forged() -> u32 {
    below(64) as u32
}

/// One random call across the boundary.
fn poke(request: Option<&ChatRequest>) {
    match below(10) {
        0 => {
            // SAFETY: deliberately not; a forged handle the host must refuse.
            let stolen = unsafe { ChatRequest::from_handle(forged()) };
            let _ = stolen.messages();
            std::mem::forget(stolen);
        }
        1 => {
            // SAFETY: as above.
            let stolen = unsafe { ChatResponse::from_handle(forged()) };
            stolen.set_text(&text());
        }
        2 => drop(ChatResponse::new(&message(), FinishReason::Complete)),
        3 => {
            let _ = context::set(&text(), &text());
        }
        4 => {
            let _ = fctx::set(&text());
        }
        5 => log::log(log::Level::Info, &text()),
        6 => {
            if let Some(request) = request {
                request.push_message(&message());
                let _ = request.set_options(&text());
            }
        }
        7 => {
            if let Some(request) = request {
                let _ = next::chat(request);
            }
        }
        8 => {
            // SAFETY: as above.
            let stolen = unsafe { ChatRequest::from_handle(forged()) };
            let _ = next::chat(&stolen);
            std::mem::forget(stolen);
        }
        _ => {
            let _ = context::get(&text());
            let _ = context::keys();
        }
    }
}

fn pokes(request: Option<&ChatRequest>) {
    for _ in 0..OPS.with(Cell::get) {
        poke(request);
    }
}

struct Chaos;

impl exports::shallot::filter::plugin::Guest for Chaos {
    fn configure(config: String) -> Result<(), String> {
        let number = |key: &str| -> Option<u64> {
            let rest = config.split(&format!("\"{key}\":")).nth(1)?;
            let digits: String = rest
                .trim_start()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        };
        STATE.with(|state| state.set(number("seed").unwrap_or(1).max(1)));
        OPS.with(|ops| ops.set(number("ops").unwrap_or(8) as u32));
        Ok(())
    }

    fn describe() -> Descriptor {
        Descriptor {
            name: "chaos".to_owned(),
            version: "0.1.0".to_owned(),
            init_fctx: "null".to_owned(),
            // Every hook, named over and over: the host keeps each once.
            hooks: [
                Hook::AroundChat,
                Hook::AroundTool,
                Hook::AroundTurn,
                Hook::TokenTransform,
                Hook::SystemPrompt,
            ]
            .repeat(10_000),
        }
    }
}

impl exports::shallot::filter::chat_filter::Guest for Chaos {
    fn around_chat(request: &ChatRequest) -> Result<ChatResponse, FilterError> {
        pokes(Some(request));
        match below(4) {
            0 => next::chat(request),
            1 => Ok(ChatResponse::new(&message(), FinishReason::Complete)),
            // SAFETY: as above.
            2 => Ok(unsafe { ChatResponse::from_handle(forged()) }),
            _ => Err(error()),
        }
    }
}

impl exports::shallot::filter::tool_filter::Guest for Chaos {
    fn around_tool(request: &ToolRequest) -> Result<ToolResponse, FilterError> {
        pokes(None);
        let _ = request.set_arguments(&text());
        match below(3) {
            0 => next::tool(request),
            1 => Ok(ToolResponse::new(&text())),
            _ => Err(error()),
        }
    }
}

impl exports::shallot::filter::turn_filter::Guest for Chaos {
    fn around_turn(request: &TurnRequest) -> TurnResult {
        pokes(None);
        if below(3) == 0 {
            request.push_message(&message());
        }
        match below(3) {
            0 => next::turn(request),
            _ => TurnResult::Error(error()),
        }
    }
}

impl exports::shallot::filter::system_prompt_filter::Guest for Chaos {
    fn system_prompt(prompt: String) -> Result<String, FilterError> {
        pokes(None);
        if below(4) == 0 {
            Err(error())
        } else {
            Ok(prompt + &text())
        }
    }
}

/// A random batch: well-formed or not (ends out of order or past the text,
/// metas out of range or not JSON).
fn batch() -> TokenBatch {
    let text = text();
    let count = below(8) as usize;
    let mut ends: Vec<u32> = (0..count)
        .map(|_| below(text.len() as u64 + 2) as u32)
        .collect();
    if below(2) == 0 {
        ends.sort_unstable();
    }
    let metas = (0..below(3))
        .map(|_| TokenMeta {
            index: below(count as u64 + 2) as u32,
            json: self::text(),
        })
        .collect();
    TokenBatch { text, ends, metas }
}

struct Transformer;

impl exports::shallot::filter::token_filter::Guest for Chaos {
    type TokenTransformer = Transformer;
}

impl GuestTokenTransformer for Transformer {
    fn new() -> Self {
        pokes(None);
        Transformer
    }

    fn step(&self, tokens: TokenBatch) -> Result<TokenBatch, FilterError> {
        pokes(None);
        match below(3) {
            0 => Ok(tokens),
            1 => Ok(batch()),
            _ => Err(error()),
        }
    }

    fn flush(&self) -> Result<TokenBatch, FilterError> {
        if below(3) == 0 {
            Err(error())
        } else {
            Ok(batch())
        }
    }
}

export!(Chaos);
