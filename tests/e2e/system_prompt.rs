//! System prompts: the caller's, one system message each, or shaped by the
//! filters' system-prompt hooks in filter order into one; applied innermost
//! and never stored in history.

use serde_json::json;
use shallot::types::Role;
use shallot::{Context, InvokeOptions, Kernel};
use shallot_tests::{Reply, ScriptedModel, load, spec};

use crate::agent::{add_tool, done, go, texts};

#[tokio::test]
async fn system_prompts_are_the_innermost_layer_and_never_stored() {
    let plugins = load(vec![spec(
        "probe",
        "rag",
        json!({ "system": "CONTEXT", "hooks": ["chat"] }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 1})),
        Reply::Text("2".into()),
    ]);
    let kernel = add_tool(Kernel::builder().plugins(&plugins))
        .model(model.clone())
        .build()
        .unwrap();
    let options = InvokeOptions::from(Context::new().with("conversation_id", "sys"))
        .system_prompt("You are terse.")
        .system_prompt("Answer in digits.");
    let done = done(kernel.turn(go("1+1"), options).await);
    for request in model.requests() {
        assert_eq!(
            texts(&request.messages)[..3],
            ["You are terse.", "Answer in digits.", "CONTEXT"],
            "every round, after the filters, one system message each (§2.3)"
        );
        let roles: Vec<Role> = request.messages[..2].iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::System]);
    }
    assert!(
        done.messages.iter().all(|m| m.role != Role::System),
        "the run's messages have no system prompt"
    );
}

#[tokio::test]
async fn system_prompt_hooks_shape_the_prompt_in_filter_order() {
    let plugins = load(vec![
        spec(
            "probe",
            "first",
            json!({ "append_system": "Be brief.", "hooks": ["system-prompt"] }),
        ),
        spec(
            "probe",
            "second",
            json!({ "append_system": "Cite sources.", "hooks": ["system-prompt"] }),
        ),
    ])
    .await;
    let model = ScriptedModel::answer("ok");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let options = InvokeOptions::from(Context::new()).system_prompt("You are X.");
    kernel
        .chat(shallot_tests::ask("hi"), options)
        .await
        .unwrap();
    assert_eq!(
        model.requests()[0].messages[0].text(),
        "You are X.\nBe brief.\nCite sources."
    );
    kernel
        .chat(shallot_tests::ask("hi"), Context::new())
        .await
        .unwrap();
    assert_eq!(
        model.requests()[1].messages[0].text(),
        "Be brief.\nCite sources.",
        "filters may add a prompt of their own"
    );
}

/// A system-prompt filter that numbers its runs: each prompt it shapes
/// says which run of the pipeline made it.
struct Numbers(std::sync::Arc<std::sync::atomic::AtomicUsize>);

#[async_trait::async_trait]
impl shallot::Filter for Numbers {
    fn name(&self) -> &str {
        "numbers"
    }

    fn hooks(&self) -> &[shallot::Hook] {
        &[shallot::Hook::SystemPrompt]
    }

    async fn system_prompt(
        &self,
        prompt: String,
        _: &shallot::FilterScope,
    ) -> Result<String, shallot::ChainError> {
        let run = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        Ok(format!("{prompt}\npipeline run {run}"))
    }
}

// The seed's article found the prompt rebuilt on every round in one
// implementation: here it is shaped once per turn, and once more when a
// paused turn resumes (a new invoke).
#[tokio::test]
async fn the_system_prompt_pipeline_runs_once_per_turn_not_per_round_and_again_on_resume() {
    let plugins = load(vec![spec(
        "probe",
        "brief",
        json!({ "append_system": "Be brief.", "hooks": ["system-prompt"] }),
    )])
    .await;
    let model = ScriptedModel::replies(vec![
        Reply::call("add", json!({"a": 1, "b": 1})),
        Reply::call("ask_human", json!({"question": "sure?"})),
        Reply::Text("done".into()),
    ]);
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ask = shallot::types::ToolSpec::new("ask_human", "asks", json!({"type": "object"}));
    let kernel = add_tool(Kernel::builder().plugins(&plugins))
        .filter(Numbers(runs.clone()))
        .interrupt_tool(ask)
        .model(model.clone())
        .build()
        .unwrap();
    let shallot::types::TurnResult::Interrupt(paused) =
        kernel.turn(go("1+1"), Context::new()).await
    else {
        panic!("the turn pauses for the human");
    };
    let prompts = |from: usize| -> Vec<String> {
        model.requests()[from..]
            .iter()
            .map(|r| r.messages[0].text())
            .collect()
    };
    assert_eq!(
        prompts(0),
        ["Be brief.\npipeline run 1", "Be brief.\npipeline run 1"],
        "two rounds, one prompt"
    );
    let decision = shallot::types::Decision::Reply("yes".into());
    done(kernel.resume(paused, decision, Context::new()).await);
    assert_eq!(
        prompts(2),
        ["Be brief.\npipeline run 2"],
        "shaped again on resume"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
}

// AgentScope's DynamicContext: the current time (and who asks) into the
// system prompt, once per invoke.
#[tokio::test]
async fn dynamic_context_puts_the_time_in_the_operators_offset_and_context_values_in_the_prompt() {
    let config = json!({
        "template": "{now}|{date}|{time}|{weekday}|{offset}|{context.user}|{context.missing}",
        "utc_offset": "+08:00",
    });
    let grants = shallot::Grants {
        clock: true,
        ..shallot::Grants::default()
    };
    let plugins = load(vec![shallot_tests::granted(
        spec("dynamic_context", "dynamic-context", config),
        grants,
    )])
    .await;
    let model = ScriptedModel::answer("ok");
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .model(model.clone())
        .build()
        .unwrap();
    let options =
        InvokeOptions::from(Context::new().with(shallot::USER, "ada")).system_prompt("You are X.");
    kernel
        .chat(shallot_tests::ask("hi"), options)
        .await
        .unwrap();
    let prompt = model.requests()[0].messages[0].text();
    let line = prompt
        .strip_prefix("You are X.\n\n")
        .unwrap_or_else(|| panic!("added after the caller's prompt: {prompt}"));
    let parts: Vec<&str> = line.split('|').collect();
    let [now, date, time, weekday, offset, user, missing] = parts[..] else {
        panic!("{line}");
    };
    assert_eq!(now, format!("{date}T{time}{}", &now[16..]), "{line}");
    assert!(now.ends_with("+08:00") && offset == "+08:00", "{line}");
    assert!(
        date.len() == 10 && date.as_bytes()[4] == b'-' && &date[..4] >= "2026",
        "{line}"
    );
    let days = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    assert!(days.contains(&weekday), "{line}");
    assert_eq!((user, missing), ("ada", "unknown"));

    for (config, grants, says) in [
        (
            json!(null),
            shallot::Grants::default(),
            "grants = { clock = true }",
        ),
        (
            json!({ "utc_offset": "+8" }),
            shallot::Grants {
                clock: true,
                ..shallot::Grants::default()
            },
            "utc_offset '+8' is not an offset",
        ),
    ] {
        let specs = vec![shallot_tests::granted(
            spec("dynamic_context", "dynamic-context", config),
            grants,
        )];
        let error = shallot::FilterSet::from_specs(&shallot_tests::engine(), specs, &mut |_| {})
            .await
            .err()
            .expect("refused");
        assert!(error.to_string().contains(says), "{error}");
    }
}

// One admission a request: an answer shown whole (a gateway's JSON answer,
// a tool's result on `/mcp`) goes through the token transforms within the
// invoke that made it, so its prompt is shaped once, not again by a second
// invoke that shows it.
#[tokio::test]
async fn an_answer_shown_whole_is_transformed_within_its_own_invoke() {
    let star = spec(
        "probe",
        "star",
        json!({ "prefix": "*", "hooks": ["tokens"] }),
    );
    let plugins = load(vec![star]).await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let model = ScriptedModel::replies(vec![
        Reply::Text("answer".into()),
        Reply::Text("again".into()),
    ]);
    let kernel = Kernel::builder()
        .plugins(&plugins)
        .filter(Numbers(runs.clone()))
        .model(model.clone())
        .build()
        .unwrap();
    let shown = || InvokeOptions::from(Context::new()).shown();
    let request = shallot::types::ChatRequest::new(vec![shallot::types::Message::user("hi")]);
    let response = kernel.chat(request, shown()).await.unwrap();
    assert_eq!(response.text(), "*answer");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    let done = done(kernel.turn(go("hi"), shown()).await);
    assert_eq!(done.response.text(), "*again", "a turn's final answer");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        model.requests()[1].messages[0].text(),
        "\npipeline run 2",
        "the prompt the model got is the one shaped"
    );
}
