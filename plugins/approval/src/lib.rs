//! `approval` (tool): decides every call of a `sensitive` tool by the
//! operator's rules; other tools run untouched (PEER-CASES I5-I7). The
//! first rule whose `tool` (a name, `*` matching any run of characters)
//! and `args` (a pattern searched in the arguments' JSON text) match
//! decides: `allow` runs it, `deny` answers with a result the model sees
//! (`{"error":{"type":"not_approved","message":...,"tool":...}}`) and the
//! tool never runs, `ask` asks the host's approval handler (the CLI asks
//! on the terminal; an embedder installs one) and runs or denies on its
//! answer. No rule matching means `default`.
//!
//! `ask` needs the host's approval handler, granted by the operator with
//! `grants = { approval = true }`. Without the grant or without a handler
//! the call is denied: approval fails closed. A handler that does not
//! answer within `timeout_ms`, or fails, gets `on_timeout` (deny by
//! default).
//!
//! Config: `{"rules": [{"tool": "delete_*", "action": "ask"}, {"tool":
//! "transfer", "args": "\"amount\":\\s*\\d{5,}", "action": "deny"}],
//! "default": "ask", "timeout_ms": 60000, "on_timeout": "deny"}`.

use regex_lite::Regex;
use serde::Deserialize;
use serde_json::json;
use shallot_guest::{
    ErrorKind, Filter, FilterError, Next, ToolRequest, ToolResponse, approval, glob, log,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Approval {
    #[serde(default)]
    rules: Vec<Rule>,
    #[serde(default = "default_action")]
    default: Action,
    #[serde(default = "default_timeout")]
    timeout_ms: u32,
    #[serde(default = "default_on_timeout")]
    on_timeout: Action,
    #[serde(default = "default_message")]
    message: String,
    /// Which calls it decides: of `sensitive` tools (the default), or of
    /// `all` tools.
    #[serde(default)]
    tools: Scope,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default)]
#[serde(rename_all = "lowercase")]
enum Scope {
    #[default]
    Sensitive,
    All,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[serde(default = "any_tool")]
    tool: String,
    args: Option<String>,
    action: Action,
    #[serde(skip)]
    pattern: Option<Regex>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Action {
    Allow,
    Deny,
    Ask,
}

fn default_action() -> Action {
    Action::Ask
}
fn default_timeout() -> u32 {
    60_000
}
fn default_on_timeout() -> Action {
    Action::Deny
}
fn default_message() -> String {
    "the call was not approved".to_owned()
}
fn any_tool() -> String {
    "*".to_owned()
}

impl Approval {
    fn decide(&self, tool: &str, arguments: &str) -> Action {
        self.rules
            .iter()
            .find(|rule| {
                glob::matches(&rule.tool, tool)
                    && rule.pattern.as_ref().is_none_or(|p| p.is_match(arguments))
            })
            .map_or(self.default, |rule| rule.action)
    }

    fn denied(&self, tool: &str, why: &str) -> ToolResponse {
        ToolResponse::from_value(&json!({
            "error": { "type": "not_approved", "message": format!("{}: {why}", self.message), "tool": tool }
        }))
    }
}

#[shallot_guest::filter(name = "approval")]
impl Filter for Approval {
    fn configure(&mut self) -> Result<(), String> {
        if self.on_timeout == Action::Ask {
            return Err("on_timeout must be allow or deny".to_owned());
        }
        for (i, rule) in self.rules.iter_mut().enumerate() {
            if let Some(args) = &rule.args {
                let pattern = Regex::new(args).map_err(|e| format!("rules[{i}].args: {e}"))?;
                rule.pattern = Some(pattern);
            }
        }
        Ok(())
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        let spec = request.tool();
        if !spec.sensitive && self.tools == Scope::Sensitive {
            return next.tool(request);
        }
        let arguments = request.arguments();
        let action = match self.decide(&spec.name, &arguments) {
            Action::Ask => {
                let reason = if spec.sensitive {
                    format!("{} is a sensitive tool", spec.name)
                } else {
                    format!("every call of a tool is asked about ({})", spec.name)
                };
                match approval::ask(&spec.name, &arguments, &reason, self.timeout_ms) {
                    Ok(true) => Action::Allow,
                    Ok(false) => {
                        return Ok(self.denied(&spec.name, "denied by the approval handler"));
                    }
                    // A handler that does not answer, or fails, gets the
                    // timeout action, as in the seed.
                    Err(error)
                        if matches!(error.kind, ErrorKind::Timeout | ErrorKind::Internal) =>
                    {
                        if self.on_timeout == Action::Deny {
                            let why = match error.kind {
                                ErrorKind::Timeout => {
                                    format!("no answer within {} ms", self.timeout_ms)
                                }
                                _ => "the approval handler failed".to_owned(),
                            };
                            return Ok(self.denied(&spec.name, &why));
                        }
                        Action::Allow
                    }
                    Err(error) => {
                        log::warn(&format!(
                            "cannot ask for approval, so denying: {}",
                            error.message
                        ));
                        return Ok(self.denied(&spec.name, "no approval handler could be asked"));
                    }
                }
            }
            action => action,
        };
        match action {
            Action::Allow => next.tool(request),
            _ => Ok(self.denied(&spec.name, "denied by policy")),
        }
    }
}
