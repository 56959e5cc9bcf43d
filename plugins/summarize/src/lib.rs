//! `summarize`: when a conversation grows past `trigger_tokens`, the older
//! messages are replaced by a summary a model writes (a side call over the
//! `model` grant, outside the onion), as LangChain's summarization
//! middleware does. The leading system messages and the latest `keep`
//! messages stay as they are, and a tool call and its results are never
//! split: the cut moves back to the assistant message that made the call.
//!
//! Tokens are estimated as a quarter of the characters (text, tool names
//! and arguments). A summary that cannot be had (the model fails, or the
//! grant's calls or tokens are spent) leaves the request as it is and is
//! logged; a missing grant fails the request (`auth`), as a configuration
//! error should.
//!
//! Each conversation past the trigger is counted in the filter's
//! `summaries` metric, by `outcome` (`summarized`, or `kept` when no
//! summary could be had).
//!
//! Config: `{"trigger_tokens": 4000, "keep": 6, "summary_tokens": 512}`.

use serde::Deserialize;
use serde_json::json;
use shallot_guest::{
    ChatRequest, ChatResponse, ErrorKind, Filter, FilterError, Message, Next, Role, context, log,
    metrics, model,
};

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Summarize {
    trigger_tokens: usize,
    keep: usize,
    summary_tokens: u32,
    prompt: String,
}

impl Default for Summarize {
    fn default() -> Self {
        Summarize {
            trigger_tokens: 4000,
            keep: 6,
            summary_tokens: 512,
            prompt: "Summarize the conversation below for the assistant that will continue it: \
                     keep the facts, names, numbers, decisions and open questions; be brief."
                .into(),
        }
    }
}

/// A rough token count: a quarter of the characters.
fn tokens(message: &Message) -> usize {
    let calls: usize = message
        .tool_calls
        .iter()
        .map(|c| c.name.len() + c.arguments.len())
        .sum();
    (message.text().chars().count() + calls).div_ceil(4)
}

fn role(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

/// The messages as a transcript for the summarizer.
fn transcript(messages: &[Message]) -> String {
    let mut lines = Vec::new();
    for m in messages {
        let mut line = format!("{}: {}", role(m.role), m.text());
        for call in &m.tool_calls {
            line.push_str(&format!(" [calls {}({})]", call.name, call.arguments));
        }
        lines.push(line);
    }
    lines.join("\n")
}

impl Summarize {
    /// Where the kept messages start: the latest `keep`, moved back past
    /// tool results to the call they answer; at least after the leading
    /// system messages.
    fn cut(&self, messages: &[Message]) -> (usize, usize) {
        let system = messages
            .iter()
            .take_while(|m| m.role == Role::System)
            .count();
        let mut cut = messages.len().saturating_sub(self.keep).max(system);
        while cut > system && cut < messages.len() && messages[cut].role == Role::Tool {
            cut -= 1;
        }
        (system, cut)
    }

    /// The summary of `old`, or why there is none.
    fn summary(&self, old: &[Message]) -> Result<String, FilterError> {
        let ask = ChatRequest::new(&[
            Message::system(self.prompt.as_str()),
            Message::user(transcript(old)),
        ]);
        ask.set_options(&json!({ "max_tokens": self.summary_tokens }).to_string())
            .map_err(FilterError::invalid)?;
        Ok(model::complete(&ask)?.message().text())
    }
}

/// Counts a conversation past the trigger in `summaries`.
fn count(outcome: &str) {
    if let Err(e) = metrics::count("summaries", &[("outcome", outcome)], 1) {
        log::warn(&format!("could not count the summary: {}", e.message));
    }
}

#[shallot_guest::filter(name = "summarize")]
impl Filter for Summarize {
    fn configure(&mut self) -> Result<(), String> {
        if self.trigger_tokens == 0 {
            return Err("trigger_tokens: must be at least 1".into());
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        let messages = request.messages();
        if messages.iter().map(tokens).sum::<usize>() <= self.trigger_tokens {
            return next.chat(request);
        }
        let (system, cut) = self.cut(&messages);
        if cut <= system {
            return next.chat(request);
        }
        let summary = match self.summary(&messages[system..cut]) {
            Ok(summary) => summary,
            Err(e) if matches!(e.kind, ErrorKind::Auth | ErrorKind::InvalidRequest) => {
                return Err(e);
            }
            Err(e) => {
                log::warn(&format!(
                    "kept the conversation whole: no summary ({})",
                    e.message
                ));
                count("kept");
                return next.chat(request);
            }
        };
        count("summarized");
        let mut kept = messages[..system].to_vec();
        kept.push(Message::system(format!(
            "Summary of the earlier conversation: {summary}"
        )));
        kept.extend_from_slice(&messages[cut..]);
        request.set_messages(&kept);
        context::set(
            "summarize",
            &json!({ "summarized": cut - system, "kept": messages.len() - cut }),
        );
        next.chat(request)
    }
}
