//! `tool-guard` (tool): access control for tool calls. The shared
//! context's value under `by` (the client key's `tenant` by default; `key`,
//! `user` or any key a filter sets) picks the rules: a call whose tool
//! matches a `deny` pattern of that value (or of `*`, every value) is
//! refused, and so is one that matches none of the `allow` patterns of
//! that value (or, when the value has no list, of `*`); without an `allow`
//! list that applies, what is not denied runs. A refused call never
//! reaches the tool: the model gets a result saying so
//! (`{"error":{"type":"not_allowed","message":...,"tool":...}}`), whether
//! or not the tool was on its menu: this is the enforcing side of a
//! trimmed menu (`tool-search` only hides). It also takes those tools off
//! the menu (around-chat: a model, and a `/mcp` client's `tools/list`, is
//! not offered what it may not call), unless `hide` is false.
//!
//! It also judges a round's calls as one batch (each call sees its round,
//! `tool-request.batch`): `per_round` refuses the calls past the first N of
//! a round, `distinct` a second call to one tool in a round, and with
//! `all_or_nothing` a round one of whose calls is refused has every call
//! refused.
//!
//! Config: `{"by": "tenant", "allow": {"acme": ["search", "read_*"], "*":
//! ["search"]}, "deny": {"*": ["delete_*"]}, "per_round": 4, "distinct":
//! true, "all_or_nothing": false, "hide": true}` (patterns: `*` matches any
//! run of characters).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::json;
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Next, ToolCall, ToolRequest, ToolResponse,
    context, glob, log,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolGuard {
    #[serde(default = "tenant")]
    by: String,
    #[serde(default)]
    allow: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    deny: BTreeMap<String, Vec<String>>,
    per_round: Option<usize>,
    #[serde(default)]
    distinct: bool,
    #[serde(default)]
    all_or_nothing: bool,
    #[serde(default = "yes")]
    hide: bool,
}

fn tenant() -> String {
    "tenant".to_owned()
}

fn yes() -> bool {
    true
}

/// The rules of every value.
const EVERY: &str = "*";

impl ToolGuard {
    /// Why a call of `tool` by `who` is refused, if it is.
    fn refusal(&self, who: Option<&str>, tool: &str) -> Option<String> {
        let named = who.map_or_else(|| "no one named".to_owned(), |who| format!("'{who}'"));
        let denied =
            who.is_some_and(|who| listed(&self.deny, who, tool)) || listed(&self.deny, EVERY, tool);
        if denied {
            return Some(format!("tool '{tool}' is denied to {} {named}", self.by));
        }
        let allowed = who
            .and_then(|who| self.allow.get(who))
            .or_else(|| self.allow.get(EVERY));
        match allowed {
            Some(patterns) if !patterns.iter().any(|p| glob::matches(p, tool)) => Some(format!(
                "tool '{tool}' is not allowed to {} {named}",
                self.by
            )),
            _ => None,
        }
    }
}

impl ToolGuard {
    /// Why the `at`-th call of `batch` is refused, if it is: by the lists,
    /// then by the round's bounds.
    fn refused_in(&self, who: Option<&str>, batch: &[ToolCall], at: usize) -> Option<String> {
        let tool = &batch[at].name;
        if let Some(why) = self.refusal(who, tool) {
            return Some(why);
        }
        if let Some(most) = self.per_round.filter(|most| at >= *most) {
            return Some(format!(
                "call {} of the round is over its limit of {most}",
                at + 1
            ));
        }
        if self.distinct && batch[..at].iter().any(|call| &call.name == tool) {
            return Some(format!(
                "tool '{tool}' is called more than once in the round"
            ));
        }
        None
    }

    /// Why `request` is refused, if it is.
    fn verdict(&self, who: Option<&str>, request: &ToolRequest) -> Option<String> {
        let mut batch = request.batch();
        let at = match batch.iter().position(|call| call.id == request.call_id()) {
            Some(at) => at,
            // A direct call, or one a filter made up: a batch of its own.
            None => {
                batch = vec![ToolCall {
                    id: request.call_id(),
                    name: request.name(),
                    arguments: request.arguments(),
                }];
                0
            }
        };
        if let Some(why) = self.refused_in(who, &batch, at) {
            return Some(why);
        }
        if !self.all_or_nothing {
            return None;
        }
        let other = (0..batch.len()).find_map(|i| Some((i, self.refused_in(who, &batch, i)?)));
        other.map(|(i, why)| {
            format!(
                "call {} of the round was refused ({why}), so every call is",
                i + 1
            )
        })
    }
}

/// Whether `rules` list a pattern of `value` that `tool` matches.
fn listed(rules: &BTreeMap<String, Vec<String>>, value: &str, tool: &str) -> bool {
    rules
        .get(value)
        .is_some_and(|patterns| patterns.iter().any(|p| glob::matches(p, tool)))
}

#[shallot_guest::filter(name = "tool-guard")]
impl Filter for ToolGuard {
    fn configure(&mut self) -> Result<(), String> {
        if self.by.trim().is_empty() {
            return Err("`by` names a context key".to_owned());
        }
        for (what, rules) in [("allow", &self.allow), ("deny", &self.deny)] {
            for (value, patterns) in rules {
                if let Some(i) = patterns.iter().position(|p| p.is_empty()) {
                    return Err(format!("{what}.{value}[{i}] is empty"));
                }
            }
        }
        if self.per_round == Some(0) {
            return Err("per_round is at least 1".to_owned());
        }
        Ok(())
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        if self.hide {
            let who = context::get_text(&self.by);
            let tools = request.tools();
            let offered: Vec<_> = tools
                .iter()
                .filter(|tool| self.refusal(who.as_deref(), &tool.name).is_none())
                .cloned()
                .collect();
            if offered.len() < tools.len() {
                request.set_tools(&offered).map_err(FilterError::invalid)?;
            }
        }
        next.chat(request)
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        let tool = request.name();
        let who = context::get_text(&self.by);
        match self.verdict(who.as_deref(), request) {
            None => next.tool(request),
            Some(why) => {
                log::info(&why);
                Ok(ToolResponse::from_value(&json!({
                    "error": { "type": "not_allowed", "message": why, "tool": tool }
                })))
            }
        }
    }
}
