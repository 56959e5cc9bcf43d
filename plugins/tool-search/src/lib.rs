//! `tool-search` (chat + tool): with many tools, offer the model one
//! search tool instead of all of them (PEER-CASES K, L). Every tool stays
//! registered; each model call is offered the search tool, then, in the
//! request's order, every tool it does not index and the indexed tools
//! the searches of this conversation found so far (all of them, or with
//! `accumulate = false` only the last search's). It indexes the tools
//! registered with the kernel (`registered-tools`, as the seed builds its
//! index from the registry) but those listed in `unindexed`; an interrupt
//! tool such as `ask_human`, a tool another filter added and a tool a
//! client sent pass through (with `indexes = "all"`, every tool of the
//! request is indexed). The search itself is served here, in around-tool,
//! over an index of the tools the model call was given: BM25 over
//! keywords, or a regex. A request with no tools is left as it is.
//!
//! Config: `{"index": "keyword", "max_results": 5, "accumulate": true,
//! "tool_name": "tool_search", "unindexed": ["calculator"], "indexes":
//! "registered"}`.

mod index;

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Next, Role, ToolRequest, ToolResponse, ToolSpec,
};

use index::{Bm25, Doc};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolSearch {
    #[serde(default)]
    index: Kind,
    #[serde(default = "default_max")]
    max_results: usize,
    #[serde(default = "yes")]
    accumulate: bool,
    #[serde(default = "default_name")]
    tool_name: String,
    /// Tools always offered, never indexed.
    #[serde(default)]
    unindexed: Vec<String>,
    /// Which tools of a request it indexes.
    #[serde(default)]
    indexes: Indexes,
    /// Regex index: whether matching is case-sensitive.
    #[serde(default)]
    case_sensitive: bool,
    /// Keyword index: how many times a tool's name counts.
    #[serde(default = "default_boost")]
    name_boost: usize,
    #[serde(default = "default_k1")]
    k1: f64,
    #[serde(default = "default_b")]
    b: f64,
    /// The search tool's description, for the model.
    #[serde(default = "default_description")]
    description: String,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Kind {
    #[default]
    Keyword,
    Regex,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Indexes {
    /// The tools registered with the kernel; the others pass through.
    #[default]
    Registered,
    /// Every tool of the request.
    All,
}

fn default_max() -> usize {
    5
}
fn yes() -> bool {
    true
}
fn default_name() -> String {
    "tool_search".to_owned()
}
fn default_boost() -> usize {
    3
}
fn default_k1() -> f64 {
    1.2
}
fn default_b() -> f64 {
    0.75
}
fn default_description() -> String {
    "Search the available tools by what you need to do, in a few keywords. Returns the names \
     of the best matching tools, which you can call from then on. Call it whenever no tool \
     you have fits the task."
        .to_owned()
}

/// What the around-tool search needs from the model call: the indexed
/// tools (name and description) it was given.
#[derive(Serialize, Deserialize, Default)]
struct Catalogue {
    tools: Vec<(String, String)>,
}

impl ToolSearch {
    fn search_spec(&self) -> ToolSpec {
        let parameters = json!({
            "type": "object",
            "properties": { "query": { "type": "string", "description": "what the tool should do, in keywords" } },
            "required": ["query"],
        });
        ToolSpec {
            name: self.tool_name.clone(),
            description: self.description.clone(),
            parameters: parameters.to_string(),
            sensitive: false,
        }
    }

    /// The names the searches in `request`'s messages found: their union
    /// (sorted), or with `accumulate` off the last one's. A result that is
    /// not a JSON array of strings counts as empty.
    fn selected(&self, request: &ChatRequest) -> BTreeSet<String> {
        let messages = request.messages();
        let searches: BTreeSet<&str> = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .flat_map(|m| &m.tool_calls)
            .filter(|call| call.name == self.tool_name)
            .map(|call| call.id.as_str())
            .collect();
        let mut results = messages
            .iter()
            .filter(|m| m.role == Role::Tool)
            .filter(|m| {
                m.tool_call_id
                    .as_deref()
                    .is_some_and(|id| searches.contains(id))
            })
            .map(|m| serde_json::from_str::<Vec<String>>(&m.text()).unwrap_or_default());
        if self.accumulate {
            results.flatten().collect()
        } else {
            results
                .next_back()
                .unwrap_or_default()
                .into_iter()
                .collect()
        }
    }

    fn search(&self, docs: &[Doc], query: &str) -> Vec<String> {
        if query.is_empty() {
            return Vec::new();
        }
        match self.index {
            Kind::Keyword => {
                let params = Bm25 {
                    k1: self.k1,
                    b: self.b,
                    name_boost: self.name_boost,
                };
                index::keyword(docs, query, self.max_results, &params)
            }
            Kind::Regex => index::regex(docs, query, self.max_results, self.case_sensitive),
        }
    }
}

#[shallot_guest::filter(name = "tool-search")]
impl Filter for ToolSearch {
    type State = Catalogue;

    fn configure(&mut self) -> Result<(), String> {
        if self.tool_name.trim().is_empty() {
            return Err("tool_name is empty".to_owned());
        }
        if self.max_results == 0 {
            return Err("max_results must be at least 1".to_owned());
        }
        if !(self.k1 >= 0.0 && self.k1.is_finite() && (0.0..=1.0).contains(&self.b)) {
            return Err("k1 must be 0 or more and b between 0 and 1".to_owned());
        }
        Ok(())
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Catalogue>,
    ) -> Result<ChatResponse, FilterError> {
        let fctx = next.fctx();
        let tools = request.tools();
        if tools.is_empty() {
            return next.chat(request);
        }
        let registered: BTreeSet<String> = match self.indexes {
            Indexes::Registered => request.registered_tools().into_iter().collect(),
            Indexes::All => tools.iter().map(|tool| tool.name.clone()).collect(),
        };
        let indexed = |tool: &ToolSpec| {
            tool.name != self.tool_name
                && !self.unindexed.contains(&tool.name)
                && registered.contains(&tool.name)
        };
        fctx.set(&Catalogue {
            tools: tools
                .iter()
                .filter(|tool| indexed(tool))
                .map(|tool| (tool.name.clone(), tool.description.clone()))
                .collect(),
        });
        let selected = self.selected(request);
        let mut offered = vec![self.search_spec()];
        offered.extend(tools.into_iter().filter(|tool| {
            tool.name != self.tool_name && (!indexed(tool) || selected.contains(&tool.name))
        }));
        request.set_tools(&offered).map_err(FilterError::invalid)?;
        next.chat(request)
    }

    fn around_tool(
        &self,
        request: &ToolRequest,
        next: Next<Catalogue>,
    ) -> Result<ToolResponse, FilterError> {
        let fctx = next.fctx();
        if request.name() != self.tool_name {
            return next.tool(request);
        }
        let arguments: Value = serde_json::from_str(&request.arguments()).unwrap_or_default();
        let query = arguments
            .get("query")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let docs: Vec<Doc> = fctx
            .get()
            .tools
            .into_iter()
            .map(|(name, description)| Doc { name, description })
            .collect();
        Ok(ToolResponse::from_value(&self.search(&docs, query)))
    }
}
