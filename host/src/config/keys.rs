//! The gateway's client keys (`[[key]]`): who may use which routes and
//! which `/mcp` tools, each key kept only as its SHA-256.

use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::Config;
use crate::plugin::LoadError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyEntry {
    name: String,
    #[serde(default)]
    tenant: Option<String>,
    sha256: Option<String>,
    env: Option<String>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    tools: Option<Vec<String>>,
    #[serde(default)]
    prompts: Option<Vec<String>>,
    #[serde(default)]
    resources: Option<Vec<String>>,
}

/// A key a client of the gateway presents (`Authorization: Bearer ...`),
/// kept only as its SHA-256.
#[derive(Clone)]
pub struct ClientKey {
    /// Who holds it, for the filters (context `key`) and the logs.
    pub name: String,
    /// The tenant it belongs to (context `tenant`), if any.
    pub tenant: Option<String>,
    /// The routes it may use, by their model names; `None`: every route.
    /// The others do not exist for it (`404`, not listed).
    pub models: Option<Vec<String>>,
    /// The tools of the gateway's `/mcp` endpoint it may list and call,
    /// as name patterns (`*` matches any run of characters); `None`:
    /// every tool. The others do not exist for it.
    tools: Option<ToolPatterns>,
    /// The prompts of `/mcp` it may list and get, as patterns; `None`:
    /// every prompt.
    prompts: Option<ToolPatterns>,
    /// The resources (by URI) and resource templates (by URI template) of
    /// `/mcp` it may list, read and subscribe to, as patterns; `None`:
    /// every one.
    resources: Option<ToolPatterns>,
    sha256: [u8; 32],
}

/// Tool-name patterns, each compiled once.
#[derive(Clone)]
struct ToolPatterns {
    written: Vec<String>,
    compiled: Arc<[regex_lite::Regex]>,
}

impl ToolPatterns {
    /// Whether `patterns` (`None`: every name) allow `name`.
    fn allow(patterns: Option<&Self>, name: &str) -> bool {
        patterns.is_none_or(|patterns| patterns.compiled.iter().any(|p| p.is_match(name)))
    }

    fn new(patterns: &[String]) -> Self {
        let compiled = patterns
            .iter()
            .map(|pattern| {
                let parts: Vec<String> = pattern.split('*').map(regex_lite::escape).collect();
                let anchored = format!("^{}$", parts.join(".*"));
                regex_lite::Regex::new(&anchored).expect("escaped text and `.*` always compile")
            })
            .collect();
        ToolPatterns {
            written: patterns.to_vec(),
            compiled,
        }
    }
}

impl ClientKey {
    /// A key from its secret text.
    pub fn new(name: impl Into<String>, tenant: Option<String>, secret: &str) -> Self {
        ClientKey {
            name: name.into(),
            tenant,
            models: None,
            tools: None,
            prompts: None,
            resources: None,
            sha256: Sha256::digest(secret.as_bytes()).into(),
        }
    }

    /// The key, allowed only the `/mcp` tools these patterns match (`*`
    /// matches any run of characters: `files_*`, `*_read`).
    pub fn for_tools(mut self, patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let patterns: Vec<String> = patterns.into_iter().map(Into::into).collect();
        self.tools = Some(ToolPatterns::new(&patterns));
        self
    }

    /// Whether the key may list and call the `/mcp` tool `tool`.
    pub fn may_call(&self, tool: &str) -> bool {
        ToolPatterns::allow(self.tools.as_ref(), tool)
    }

    /// The key, allowed only the `/mcp` prompts these patterns match.
    pub fn for_prompts(mut self, patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let patterns: Vec<String> = patterns.into_iter().map(Into::into).collect();
        self.prompts = Some(ToolPatterns::new(&patterns));
        self
    }

    /// Whether the key may list and get the `/mcp` prompt `prompt`.
    pub fn may_prompt(&self, prompt: &str) -> bool {
        ToolPatterns::allow(self.prompts.as_ref(), prompt)
    }

    /// The key, allowed only the `/mcp` resources whose URIs (and
    /// templates whose URI templates) these patterns match
    /// (`file:///docs/*`).
    pub fn for_resources(mut self, patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let patterns: Vec<String> = patterns.into_iter().map(Into::into).collect();
        self.resources = Some(ToolPatterns::new(&patterns));
        self
    }

    /// Whether the key may list, read and subscribe to the `/mcp`
    /// resource `uri` (or list the template `uri`).
    pub fn may_read(&self, uri: &str) -> bool {
        ToolPatterns::allow(self.resources.as_ref(), uri)
    }

    /// The key, allowed only the routes of these model names.
    pub fn for_models(mut self, models: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.models = Some(models.into_iter().map(Into::into).collect());
        self
    }

    /// Whether the key may use the route of `model`.
    pub fn may_use(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|m| m == model))
    }

    /// What tells this key from any other (two keys may share a name):
    /// its secret's SHA-256.
    pub(crate) fn fingerprint(&self) -> [u8; 32] {
        self.sha256
    }

    /// Whether `secret` is this key.
    pub fn matches(&self, secret: &str) -> bool {
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        digest == self.sha256
    }
}

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientKey")
            .field("name", &self.name)
            .field("tenant", &self.tenant)
            .field("models", &self.models)
            .field("tools", &self.tools.as_ref().map(|t| &t.written))
            .field("prompts", &self.prompts.as_ref().map(|t| &t.written))
            .field("resources", &self.resources.as_ref().map(|t| &t.written))
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The client keys (`[[key]]` tables), for the gateway: each with a
    /// `name`, an optional `tenant`, the key as its hex `sha256` or the
    /// name of the environment variable (`env`) that holds it, and
    /// optionally the `models` (routes) it may use and the `tools`,
    /// `prompts` and `resources` (by URI) of `/mcp` it may use, all when
    /// not given.
    ///
    /// ```toml
    /// [[key]]
    /// name = "billing-app"
    /// tenant = "acme"
    /// sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    /// models = ["gpt-4o-mini"]
    /// tools = ["files_read*"]             # the /mcp tools it may list and call
    /// prompts = ["files_*"]               # the /mcp prompts it may list and get
    /// resources = ["file:///docs/*"]      # the /mcp resources it may list and read
    ///
    /// [[key]]
    /// name = "ops"
    /// env = "SHALLOT_OPS_KEY"
    /// ```
    pub fn keys(&self) -> Result<Vec<ClientKey>, LoadError> {
        let keys = &self.parsed.keys;
        // A conversation's id is prefixed with its owner, the key's tenant or,
        // without one, the key's name: owners must not be confused.
        let tenants: std::collections::HashSet<&str> =
            keys.iter().filter_map(|k| k.tenant.as_deref()).collect();
        keys.iter()
            .map(|key| {
                let named = |what: &str| self.bad(format!("key '{}': {what}", key.name));
                if key.name.contains('/') || key.tenant.as_ref().is_some_and(|t| t.contains('/')) {
                    return Err(named(
                        "a key's name and tenant cannot hold '/' (they prefix the ids of its conversations)",
                    ));
                }
                if key.tenant.is_none() && tenants.contains(key.name.as_str()) {
                    return Err(named(
                        "it has no tenant and a tenant has its name: they would share conversations; give it that tenant or another name",
                    ));
                }
                if key.models.as_ref().is_some_and(Vec::is_empty) {
                    return Err(named(
                        "`models` is empty: the key could use nothing (leave it out for every route)",
                    ));
                }
                let tools = key.tools.as_deref().map(ToolPatterns::new);
                let prompts = key.prompts.as_deref().map(ToolPatterns::new);
                let resources = key.resources.as_deref().map(ToolPatterns::new);
                match (&key.sha256, &key.env) {
                    (Some(hex), None) => {
                        let sha256 = decode_sha256(hex)
                            .ok_or_else(|| named("`sha256` must be 64 hex digits"))?;
                        Ok(ClientKey {
                            name: key.name.clone(),
                            tenant: key.tenant.clone(),
                            models: key.models.clone(),
                            tools,
                            prompts,
                            resources,
                            sha256,
                        })
                    }
                    (None, Some(var)) => {
                        let secret = std::env::var(var).map_err(|_| {
                            named(&format!("the environment variable {var} is not set"))
                        })?;
                        Ok(ClientKey {
                            models: key.models.clone(),
                            tools,
                            prompts,
                            resources,
                            ..ClientKey::new(key.name.clone(), key.tenant.clone(), &secret)
                        })
                    }
                    _ => Err(named("give exactly one of `sha256` and `env`")),
                }
            })
            .collect()
    }
}

fn decode_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}
