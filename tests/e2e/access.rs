//! Who may call which tool (issue rows "trimming the tool menu is not
//! access control"): by default a registered tool the model names runs
//! whether it was offered or not, as in the seed; the tool loop's
//! `offered_only` refuses it, and the `tool-guard` plugin refuses calls by
//! allow and deny lists per tenant (or any context value), offered or
//! not, and takes what it refuses off the menu.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use shallot::types::{ChatRequest, Message, Role, ToolSpec, TurnRequest, TurnResult};
use shallot::{ChainError, Context, Kernel, LoopConfig, NoHistory, TENANT, ToolLoop};
use shallot_tests::{Reply, ScriptedModel, load, spec};

/// A chat filter that takes `delete_all` off the model's menu.
struct Trims;

#[async_trait::async_trait]
impl shallot::Filter for Trims {
    fn name(&self) -> &str {
        "trims"
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        let tools: Vec<ToolSpec> = request
            .tools
            .iter()
            .filter(|t| t.name != "delete_all")
            .cloned()
            .collect();
        next.call(request.with_tools(tools)).await
    }
}

/// A model that calls `tool` once, then says what it was told.
fn calls(tool: &'static str) -> ScriptedModel {
    ScriptedModel::new(move |_, request: &ChatRequest| {
        let last = request.messages.last().unwrap();
        match last.role {
            Role::Tool => Reply::Text(format!("told: {}", last.text())),
            _ => Reply::call(tool, json!({})),
        }
    })
}

/// A kernel over `model` with the tools `search` and `delete_all`
/// (counting their runs in `ran`), `filters` and `config`.
fn kernel(
    model: ScriptedModel,
    config: LoopConfig,
    filters: Option<&shallot::FilterSet>,
    ran: &Arc<AtomicUsize>,
) -> Kernel {
    let mut builder = Kernel::builder()
        .model(model)
        .filter(Trims)
        .turn_terminal(ToolLoop::new(config, NoHistory));
    if let Some(filters) = filters {
        builder = builder.plugins(filters);
    }
    for name in ["search", "delete_all"] {
        let ran = ran.clone();
        let spec = ToolSpec::new(name, name, json!({ "type": "object" }));
        builder = builder.tool(spec, move |_: Value, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async move { Ok(json!(format!("{name} ran"))) }
        });
    }
    builder.build().unwrap()
}

async fn turn(kernel: &Kernel, tenant: &str) -> shallot::types::TurnDone {
    let context = Context::new().with(TENANT, tenant);
    let request = TurnRequest::new(vec![Message::user("go")]);
    match kernel.turn(request, context).await {
        TurnResult::Done(done) => done,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_registered_tool_off_the_menu_runs_by_default_and_not_with_offered_only() {
    let ran = Arc::new(AtomicUsize::new(0));
    let open = kernel(calls("delete_all"), LoopConfig::default(), None, &ran);
    let done = turn(&open, "acme").await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the seed's behaviour: it runs"
    );
    assert_eq!(done.response.text(), "told: delete_all ran");

    let ran = Arc::new(AtomicUsize::new(0));
    let config = LoopConfig {
        offered_only: true,
        ..LoopConfig::default()
    };
    let closed = kernel(calls("delete_all"), config, None, &ran);
    let done = turn(&closed, "acme").await;
    assert_eq!(ran.load(Ordering::SeqCst), 0, "never runs");
    let error = done.tool_calls[0].error.as_ref().expect("refused");
    assert!(error.message.contains("was not offered"), "{error}");
    assert!(
        done.response.text().contains("was not offered"),
        "the model is told"
    );

    // What was offered still runs.
    let offered = kernel(calls("search"), config, None, &ran);
    turn(&offered, "acme").await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn tool_guard_refuses_by_tenant_what_it_does_not_allow_offered_or_not() {
    let guard = spec(
        "tool_guard",
        "tool-guard",
        json!({ "allow": { "acme": ["search", "delete_*"], "*": ["search"] }, "deny": { "*": ["delete_all"] } }),
    );
    let plugins = load(vec![guard]).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let guarded = |tool| kernel(calls(tool), LoopConfig::default(), Some(&plugins), &ran);

    let done = turn(&guarded("search"), "acme").await;
    assert_eq!(done.response.text(), "told: search ran");
    // Denied to every tenant, allowed or not, on the menu or not.
    let done = turn(&guarded("delete_all"), "acme").await;
    let refused: Value =
        serde_json::from_str(done.tool_calls[0].output.as_deref().unwrap()).unwrap();
    assert_eq!(refused["error"]["type"], "not_allowed", "{refused}");
    assert_eq!(refused["error"]["tool"], "delete_all");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant 'acme'"),
        "{refused}"
    );
    // Another tenant has only the `*` list.
    let done = turn(&guarded("search"), "globex").await;
    assert_eq!(done.response.text(), "told: search ran");
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "search ran twice, delete_all never"
    );

    // The model is offered only what it may call; with `hide = false`,
    // the menu is left as it was.
    let offered = async |config: Value, tenant: &str| -> Vec<String> {
        let model = calls("search");
        let plugins = load(vec![spec("tool_guard", "tool-guard", config)]).await;
        let mut builder = Kernel::builder()
            .model(model.clone())
            .plugins(&plugins)
            .turn_terminal(ToolLoop::new(LoopConfig::default(), NoHistory));
        for name in ["search", "read_file", "delete_all"] {
            let spec = ToolSpec::new(name, name, json!({ "type": "object" }));
            builder = builder.tool(spec, |_: Value, _| async { Ok(json!("ran")) });
        }
        turn(&builder.build().unwrap(), tenant).await;
        let asked = model.requests();
        asked[0].tools.iter().map(|t| t.name.clone()).collect()
    };
    let rules = json!({ "allow": { "acme": ["search", "read_*"], "*": ["search"] }, "deny": { "*": ["delete_*"] } });
    assert_eq!(
        offered(rules.clone(), "acme").await,
        ["read_file", "search"]
    );
    assert_eq!(offered(rules, "globex").await, ["search"]);
    let shown = json!({ "deny": { "*": ["delete_all"] }, "hide": false });
    assert_eq!(
        offered(shown, "acme").await,
        ["delete_all", "read_file", "search"]
    );

    for (config, says) in [
        (json!({ "by": " " }), "`by` names a context key"),
        (
            json!({ "allow": { "acme": [""] } }),
            "allow.acme[0] is empty",
        ),
        (json!({ "allow": ["search"] }), "invalid type"),
    ] {
        let error = super::loading::refused("tool_guard", "tool-guard", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// A tool a chat filter adds to the menu (not registered; the filter
/// serves its calls).
pub(crate) struct Adds;

#[async_trait::async_trait]
impl shallot::Filter for Adds {
    fn name(&self) -> &str {
        "adds"
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: shallot::Next<shallot::Chat>,
    ) -> Result<shallot::types::ChatResponse, ChainError> {
        let mut tools = request.tools.to_vec();
        tools.push(ToolSpec::new(
            "lookup",
            "looks up",
            json!({ "type": "object" }),
        ));
        next.call(request.with_tools(tools)).await
    }

    async fn around_tool(
        &self,
        request: shallot::types::ToolRequest,
        next: shallot::Next<shallot::Tool>,
    ) -> Result<shallot::types::ToolResponse, ChainError> {
        if request.tool.name == "lookup" {
            return Ok(shallot::types::ToolResponse::json(&json!("found it")));
        }
        next.call(request).await
    }
}

/// A paused turn keeps the menu its model was offered: a call to a tool a
/// filter added, held by the loop's policy and approved, still reaches the
/// filter after the resume (it was `not-found` there before), and under
/// `offered_only` still counts as offered.
#[tokio::test]
async fn a_resumed_turn_keeps_the_tools_its_model_was_offered() {
    for offered_only in [false, true] {
        let config = LoopConfig {
            offered_only,
            ..LoopConfig::default()
        };
        let held = ToolLoop::new(config, NoHistory)
            .on_tool_call(|call| (call.name == "lookup").then(|| "ask first".to_owned()));
        let kernel = Kernel::builder()
            .model(calls("lookup"))
            .filter(Adds)
            .turn_terminal(held)
            .build()
            .unwrap();
        let request = TurnRequest::new(vec![Message::user("go")]);
        let TurnResult::Interrupt(held) = kernel.turn(request, Context::new()).await else {
            panic!("the call is held");
        };
        let resumed = kernel
            .resume(held, shallot::types::Decision::Approve, Context::new())
            .await;
        let TurnResult::Done(done) = resumed else {
            panic!("{resumed:?}");
        };
        assert_eq!(
            done.response.text(),
            "told: found it",
            "offered_only: {offered_only}"
        );
    }
}

/// A model that calls `tools` every round, whatever it is told.
fn insists(tools: &'static [&'static str]) -> ScriptedModel {
    ScriptedModel::new(move |_, _: &ChatRequest| {
        Reply::Calls(tools.iter().map(|t| ((*t).to_owned(), json!({}))).collect())
    })
}

/// The turn over a model that keeps calling `tools`, through `filters`,
/// with the loop's `stop_on_all_denied` as given (and `policy` holding
/// calls, denied on resume).
async fn insisting(
    tools: &'static [&'static str],
    filters: &shallot::FilterSet,
    stop_on_all_denied: bool,
    policy: bool,
) -> TurnResult {
    let ran = Arc::new(AtomicUsize::new(0));
    let config = LoopConfig {
        stop_on_all_denied,
        ..LoopConfig::default()
    };
    let mut tool_loop = ToolLoop::new(config, NoHistory);
    if policy {
        tool_loop =
            tool_loop.on_tool_call(|call| (call.name == "search").then(|| "ask".to_owned()));
    }
    let mut builder = Kernel::builder()
        .model(insists(tools))
        .plugins(filters)
        .turn_terminal(tool_loop);
    for name in ["search", "delete_all"] {
        let ran = ran.clone();
        let spec = ToolSpec::new(name, name, json!({ "type": "object" }));
        builder = builder.tool(spec, move |_: Value, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async move { Ok(json!("ran")) }
        });
    }
    let kernel = builder.build().unwrap();
    let context = Context::new().with(TENANT, "acme");
    let result = kernel
        .turn(TurnRequest::new(vec![Message::user("go")]), context.clone())
        .await;
    match result {
        TurnResult::Interrupt(held) if policy => {
            kernel
                .resume(
                    held,
                    shallot::types::Decision::Deny("not today".into()),
                    context,
                )
                .await
        }
        other => other,
    }
}

// AgentScope's StopOnAllDenied (seed 004).
/// When every call of a round is refused — by `approval`'s deny rule, by
/// `tool-guard`, or by a human denying what the policy held — the turn
/// stops there with an answer saying so, instead of asking the model again
/// until the rounds run out; a round with one call that ran goes on.
#[tokio::test]
async fn a_turn_whose_every_call_is_refused_stops_instead_of_asking_again() {
    let approval = load(vec![spec(
        "approval",
        "approval",
        json!({ "tools": "all", "rules": [{ "tool": "delete_*", "action": "deny" }], "default": "allow" }),
    )])
    .await;
    let guard = load(vec![spec(
        "tool_guard",
        "tool-guard",
        json!({ "deny": { "*": ["delete_all"] } }),
    )])
    .await;
    let none = load(vec![]).await;
    for (what, filters, tools, policy, says) in [
        (
            "approval",
            &approval,
            &["delete_all"][..],
            false,
            "not approved",
        ),
        (
            "tool-guard",
            &guard,
            &["delete_all", "delete_all"][..],
            false,
            "denied to tenant",
        ),
        ("a denied hold", &none, &["search"][..], true, "not today"),
    ] {
        let stopped = insisting(tools, filters, true, policy).await;
        let TurnResult::Done(done) = stopped else {
            panic!("{what}: {stopped:?}");
        };
        assert_eq!(done.iterations, 1, "{what}: one round, not ten");
        assert_eq!(
            done.response.finish_reason,
            shallot::types::FinishReason::ContentFiltered,
            "{what}"
        );
        assert_eq!(done.response.metadata["stopped"], "all_denied", "{what}");
        assert!(
            done.response.text().contains(says),
            "{what}: {}",
            done.response.text()
        );

        // Without the option the model is asked again and again.
        let asked = insisting(tools, filters, false, policy).await;
        assert!(
            !matches!(&asked, TurnResult::Done(d) if d.iterations == 1),
            "{what}: {asked:?}"
        );
    }
    // One call of the round ran: the turn goes on (to the round limit here).
    let mixed = insisting(&["search", "delete_all"], &guard, true, false).await;
    let TurnResult::Error(error) = mixed else {
        panic!("{mixed:?}");
    };
    assert_eq!(error.kind, shallot::ErrorKind::LimitExceeded, "{error}");
}

/// A model whose first round asks for `tools`, one call each, in order,
/// and then says what it was told of each.
fn batch_of(tools: &'static [&'static str], arguments: Value) -> ScriptedModel {
    ScriptedModel::new(move |_, request: &ChatRequest| {
        let last = request.messages.last().unwrap();
        match last.role {
            Role::Tool => Reply::Text("done".into()),
            _ => Reply::Calls(
                tools
                    .iter()
                    .map(|t| (t.to_string(), arguments.clone()))
                    .collect(),
            ),
        }
    })
}

/// The type of each call's result: what ran says so, what was refused is
/// `not_allowed`.
fn outcomes(done: &shallot::types::TurnDone) -> Vec<String> {
    done.tool_calls
        .iter()
        .map(|call| {
            let output: Value = serde_json::from_str(call.output.as_deref().unwrap()).unwrap();
            match output["error"]["type"].as_str() {
                Some(kind) => format!("{kind}: {}", output["error"]["message"].as_str().unwrap()),
                None => output.as_str().unwrap().to_owned(),
            }
        })
        .collect()
}

#[tokio::test]
async fn tool_guard_judges_a_rounds_calls_as_one_batch() {
    const ROUND: &[&str] = &["search", "search", "delete_all", "search"];
    for (config, expect) in [
        (
            json!({ "per_round": 2 }),
            vec![
                "search ran",
                "search ran",
                "not_allowed: call 3 of the round is over its limit of 2",
                "not_allowed: call 4 of the round is over its limit of 2",
            ],
        ),
        (
            json!({ "distinct": true }),
            vec![
                "search ran",
                "not_allowed: tool 'search' is called more than once in the round",
                "delete_all ran",
                "not_allowed: tool 'search' is called more than once in the round",
            ],
        ),
        (
            json!({ "deny": { "*": ["delete_all"] }, "all_or_nothing": true }),
            vec![
                "not_allowed: call 3 of the round was refused (tool 'delete_all' is denied to tenant 'acme'), so every call is",
                "not_allowed: call 3 of the round was refused (tool 'delete_all' is denied to tenant 'acme'), so every call is",
                "not_allowed: tool 'delete_all' is denied to tenant 'acme'",
                "not_allowed: call 3 of the round was refused (tool 'delete_all' is denied to tenant 'acme'), so every call is",
            ],
        ),
    ] {
        let plugins = load(vec![spec("tool_guard", "tool-guard", config.clone())]).await;
        let ran = Arc::new(AtomicUsize::new(0));
        let kernel = kernel(
            batch_of(ROUND, json!({})),
            LoopConfig::default(),
            Some(&plugins),
            &ran,
        );
        let done = turn(&kernel, "acme").await;
        assert_eq!(outcomes(&done), expect, "{config}");
        let runs = expect.iter().filter(|e| e.ends_with(" ran")).count();
        assert_eq!(ran.load(Ordering::SeqCst), runs, "{config}");
    }
    let error =
        super::loading::refused("tool_guard", "tool-guard", json!({ "per_round": 0 })).await;
    assert!(
        error.to_string().contains("per_round is at least 1"),
        "{error}"
    );
}

/// Reads the batch its tool calls see into its private context, by call.
struct Sees;

#[async_trait::async_trait]
impl shallot::Filter for Sees {
    fn name(&self) -> &str {
        "sees"
    }

    async fn around_tool(
        &self,
        request: shallot::types::ToolRequest,
        next: shallot::Next<shallot::Tool>,
    ) -> Result<shallot::types::ToolResponse, ChainError> {
        let batch: Vec<String> = request.batch.iter().map(|c| c.name.clone()).collect();
        let mine = request.batch.iter().position(|c| *c.id == *request.call_id);
        let response = next.call(request).await?;
        Ok(shallot::types::ToolResponse::json(
            &json!({ "batch": batch, "mine": mine, "was": response.output }),
        ))
    }
}

#[tokio::test]
async fn every_call_of_a_round_sees_the_whole_round_and_a_direct_call_none() {
    let kernel = Kernel::builder()
        .model(batch_of(&["search", "delete_all"], json!({})))
        .filter(Sees)
        .tool(
            ToolSpec::new("search", "", json!({ "type": "object" })),
            |_: Value, _| async { Ok(json!("hit")) },
        )
        .tool(
            ToolSpec::new("delete_all", "", json!({ "type": "object" })),
            |_: Value, _| async { Ok(json!("gone")) },
        )
        .build()
        .unwrap();
    let done = turn(&kernel, "acme").await;
    let seen: Vec<Value> = done
        .tool_calls
        .iter()
        .map(|c| serde_json::from_str(c.output.as_deref().unwrap()).unwrap())
        .collect();
    assert_eq!(seen[0]["batch"], json!(["search", "delete_all"]));
    assert_eq!(seen[1]["batch"], json!(["search", "delete_all"]));
    assert_eq!((&seen[0]["mine"], &seen[1]["mine"]), (&json!(0), &json!(1)));
    let direct = kernel
        .tool("search", json!({}), Context::new())
        .await
        .unwrap();
    let direct: Value = serde_json::from_str(&direct.output).unwrap();
    assert_eq!(
        (&direct["batch"], &direct["mine"]),
        (&json!([]), &Value::Null)
    );
}

#[tokio::test]
async fn a_filter_that_reads_its_batch_without_end_fails_only_its_own_calls() {
    let chatter = spec(
        "misbehave",
        "chatter",
        json!({ "on": "tool", "do": "batch-chatter" }),
    );
    let plugins = load(vec![chatter]).await;
    // A round of 8 calls of 256 KiB of arguments each, copied in on
    // every read.
    let arguments = json!({ "pad": "x".repeat(256 << 10) });
    let ran = Arc::new(AtomicUsize::new(0));
    let tools: &'static [&'static str] = &["search"; 8];
    let kernel = kernel(
        batch_of(tools, arguments),
        LoopConfig::default(),
        Some(&plugins),
        &ran,
    );
    let done = turn(&kernel, "acme").await;
    assert_eq!(done.response.text(), "done", "the turn goes on");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    for call in &done.tool_calls {
        let error = call.error.as_ref().expect("the filter's call faulted");
        assert_eq!(error.kind, shallot::ErrorKind::PluginFault, "{error}");
    }
}
