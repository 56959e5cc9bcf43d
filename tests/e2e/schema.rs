//! The schema-validation filter: PEER-CASES H9-H14 (re-entry through a
//! turn) and J (the validator, through the feedback the model is sent),
//! with where the full 2020-12 validator is stricter than the peer's
//! subset.

use serde_json::{Value, json};
use shallot::types::TurnResult;
use shallot_tests::{ScriptedModel, spec};

use crate::agent::{done, texts};
use crate::loading::refused;

async fn validated(config: Value, answers: &[&str]) -> (TurnResult, ScriptedModel) {
    let filter = spec("schema_validation", "schema-validation", config);
    crate::guards::answered(filter, answers).await
}

/// What `schema` says of `instance`: `None` when it passes, else the
/// errors as the feedback lists them (`path: message (keyword)`).
async fn errors_with(schema: Value, instance: Value, extra: Value) -> Option<Vec<String>> {
    let mut config = json!({ "schema": schema, "max_retries": 1 });
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().cloned().unwrap_or_default());
    let (_, model) = validated(config, &[&instance.to_string(), "done"]).await;
    if model.calls() == 1 {
        return None;
    }
    let feedback = texts(&model.requests()[1].messages).pop().unwrap();
    let listed = feedback
        .split_once("the JSON does not match the schema: ")
        .unwrap_or_else(|| panic!("{feedback}"))
        .1
        .trim_end_matches(". Please correct it and answer again.");
    Some(listed.split("; ").map(str::to_owned).collect())
}

async fn errors(schema: Value, instance: Value) -> Option<Vec<String>> {
    errors_with(schema, instance, json!({})).await
}

/// The (path, keyword) of each error.
async fn failing(schema: Value, instance: Value) -> Vec<(String, String)> {
    errors(schema.clone(), instance.clone())
        .await
        .unwrap_or_else(|| panic!("{instance} should fail {schema}"))
        .iter()
        .map(|e| {
            let (path, rest) = e.split_once(": ").unwrap();
            let keyword = rest.rsplit_once(" (").unwrap().1.trim_end_matches(')');
            (path.to_owned(), keyword.to_owned())
        })
        .collect()
}

fn at(path: &str, keyword: &str) -> Vec<(String, String)> {
    vec![(path.to_owned(), keyword.to_owned())]
}

async fn passes(schema: Value, instance: Value) {
    assert_eq!(
        errors(schema.clone(), instance.clone()).await,
        None,
        "{instance} against {schema}"
    );
}

fn person() -> Value {
    json!({
        "type": "object",
        "properties": { "name": { "type": "string" }, "age": { "type": "integer", "minimum": 0 } },
        "required": ["name", "age"],
    })
}

// PEER-CASES H9, H10
#[tokio::test]
async fn schema_validation_reenters_with_the_failing_field_named() {
    let config = json!({ "schema": person(), "max_retries": 2 });
    let (result, model) =
        validated(config, &[r#"{"name":"bob"}"#, r#"{"name":"bob","age":30}"#]).await;
    assert_eq!(done(result).response.text(), r#"{"name":"bob","age":30}"#);
    assert_eq!(model.calls(), 2);
    assert!(
        texts(&model.requests()[1].messages)
            .concat()
            .contains("age")
    );
}

// PEER-CASES H11
#[tokio::test]
async fn an_answer_that_is_not_json_is_sent_back() {
    let config = json!({ "schema": person() });
    let (result, model) = validated(config, &["我想想……", r#"{"name":"a","age":1}"#]).await;
    assert_eq!(done(result).response.text(), r#"{"name":"a","age":1}"#);
    assert!(
        texts(&model.requests()[1].messages)
            .pop()
            .unwrap()
            .contains("not valid JSON")
    );
}

// PEER-CASES H12, H13
#[tokio::test]
async fn a_code_fence_is_stripped_unless_turned_off() {
    let fenced = "Here it is:\n```json\n{\"name\":\"a\",\"age\":1}\n```";
    let (_, model) = validated(json!({ "schema": person() }), &[fenced]).await;
    assert_eq!(model.calls(), 1);
    let config = json!({ "schema": person(), "code_fence": false, "max_retries": 1 });
    let (_, model) = validated(config, &[fenced]).await;
    assert_eq!(model.calls(), 2);
}

// PEER-CASES H14
#[tokio::test]
async fn exhausted_retries_return_the_last_answer_without_an_error() {
    let config = json!({ "schema": person(), "max_retries": 1 });
    let (result, model) = validated(config, &["{}"]).await;
    assert_eq!(done(result).response.text(), "{}");
    assert_eq!(model.calls(), 2);
}

// PEER-CASES J1, J2, J3, J4, J5, J6, J7, J8
#[tokio::test]
async fn the_validator_checks_types_unions_and_nullable() {
    passes(json!({ "type": "string" }), json!("hi")).await;
    assert_eq!(
        failing(json!({ "type": "string" }), json!(1)).await,
        at("#", "type")
    );
    for (ty, value) in [
        ("object", json!({})),
        ("array", json!([])),
        ("boolean", json!(true)),
        ("null", json!(null)),
        ("number", json!(1.5)),
        ("integer", json!(3)),
        ("number", json!(3)),
        ("integer", json!(1.0)),
    ] {
        passes(json!({ "type": ty }), value).await;
    }
    for (ty, value) in [
        ("number", json!(true)),
        ("object", json!(null)),
        ("array", json!({})),
    ] {
        assert_eq!(failing(json!({ "type": ty }), value).await, at("#", "type"));
    }
    assert_eq!(
        failing(json!({ "type": "integer" }), json!(1.5)).await,
        at("#", "type")
    );
    let union = json!({ "type": ["string", "null"] });
    passes(union.clone(), json!("a")).await;
    passes(union.clone(), json!(null)).await;
    assert_eq!(failing(union, json!(1)).await, at("#", "type"));
    let nullable = json!({ "type": "string", "nullable": true });
    passes(nullable.clone(), json!(null)).await;
    passes(nullable, json!("a")).await;
    assert_eq!(
        failing(json!({ "type": "string" }), json!(null)).await,
        at("#", "type")
    );
}

// PEER-CASES J9, J10, J11, J12, J13, J14, J15, J16, J17, J18
#[tokio::test]
async fn the_validator_checks_enum_const_numbers_strings_and_arrays() {
    passes(json!({ "enum": ["a", "b"] }), json!("b")).await;
    assert_eq!(
        failing(json!({ "enum": ["a", "b"] }), json!("c")).await,
        at("#", "enum")
    );
    passes(json!({ "const": 1 }), json!(1.0)).await;
    assert_eq!(
        failing(json!({ "const": "x" }), json!("y")).await,
        at("#", "const")
    );
    let bounds = json!({ "type": "number", "minimum": 1, "maximum": 10 });
    passes(bounds.clone(), json!(1)).await;
    passes(bounds.clone(), json!(10)).await;
    assert_eq!(failing(bounds.clone(), json!(0)).await, at("#", "minimum"));
    assert_eq!(failing(bounds, json!(11)).await, at("#", "maximum"));
    let exclusive = json!({ "exclusiveMinimum": 1, "exclusiveMaximum": 10 });
    passes(exclusive.clone(), json!(5)).await;
    assert_eq!(
        failing(exclusive.clone(), json!(1)).await,
        at("#", "exclusiveMinimum")
    );
    assert_eq!(
        failing(exclusive, json!(10)).await,
        at("#", "exclusiveMaximum")
    );
    passes(json!({ "multipleOf": 3 }), json!(9)).await;
    assert_eq!(
        failing(json!({ "multipleOf": 3 }), json!(10)).await,
        at("#", "multipleOf")
    );
    passes(json!({ "multipleOf": 0.5 }), json!(1.5)).await;
    passes(json!({ "minimum": 5 }), json!("str")).await;
    passes(json!({ "maxLength": 2 }), json!("你好")).await;
    assert_eq!(
        failing(json!({ "maxLength": 1 }), json!("你好")).await,
        at("#", "maxLength")
    );
    assert_eq!(
        failing(json!({ "minLength": 3 }), json!("ab")).await,
        at("#", "minLength")
    );
    passes(json!({ "pattern": "^[a-z]+$" }), json!("abc")).await;
    assert_eq!(
        failing(json!({ "pattern": "^[a-z]+$" }), json!("Abc1")).await,
        at("#", "pattern")
    );
    let counts = json!({ "type": "array", "minItems": 1, "maxItems": 2 });
    passes(counts.clone(), json!([1])).await;
    assert_eq!(
        failing(counts.clone(), json!([])).await,
        at("#", "minItems")
    );
    assert_eq!(failing(counts, json!([1, 2, 3])).await, at("#", "maxItems"));
}

// PEER-CASES J20, J21, J22, J23, J24, J25, J26
#[tokio::test]
async fn the_validator_checks_items_and_objects_at_their_paths() {
    let strings = json!({ "type": "array", "items": { "type": "string" } });
    passes(strings.clone(), json!(["a", "b"])).await;
    let mut both = at("/1", "type");
    both.extend(at("/2", "type"));
    assert_eq!(failing(strings, json!(["a", 1, true])).await, both);
    assert_eq!(
        failing(json!({ "required": ["a"] }), json!({})).await,
        at("#", "required")
    );
    passes(json!({ "required": ["a"] }), json!({ "a": 1 })).await;
    let n = json!({ "type": "object", "properties": { "n": { "type": "integer" } } });
    passes(n.clone(), json!({})).await;
    passes(n.clone(), json!({ "n": 1 })).await;
    assert_eq!(failing(n, json!({ "n": "x" })).await, at("/n", "type"));
    let closed = json!({ "properties": { "a": {} }, "additionalProperties": false });
    passes(closed.clone(), json!({ "a": 1 })).await;
    assert_eq!(
        failing(closed, json!({ "a": 1, "b": 2 })).await,
        at("#", "additionalProperties")
    );
    passes(
        json!({ "additionalProperties": true }),
        json!({ "b": "any" }),
    )
    .await;
    let typed = json!({ "additionalProperties": { "type": "string" } });
    passes(typed.clone(), json!({ "b": "s" })).await;
    assert_eq!(failing(typed, json!({ "b": 1 })).await, at("/b", "type"));
    let nested = json!({ "properties": { "items": { "items": { "properties": { "name": { "type": "string" } } } } } });
    assert_eq!(
        failing(
            nested,
            json!({ "items": [{ "name": "ok" }, { "name": 42 }] })
        )
        .await,
        at("/items/1/name", "type")
    );
}

// PEER-CASES J27, J28, J30, J31, J34, J35, J36
#[tokio::test]
async fn the_validator_checks_combinators_boolean_schemas_limits_and_rendering() {
    let any = json!({ "anyOf": [{ "type": "string" }, { "type": "integer" }] });
    passes(any.clone(), json!("a")).await;
    passes(any.clone(), json!(1)).await;
    assert_eq!(failing(any, json!(true)).await, at("#", "anyOf"));
    let all = json!({ "allOf": [{ "type": "integer" }, { "minimum": 10 }] });
    passes(all.clone(), json!(11)).await;
    assert_eq!(
        failing(all, json!(1)).await,
        at("#", "minimum"),
        "the branch's own error"
    );
    passes(json!({ "not": { "type": "string" } }), json!(1)).await;
    assert_eq!(
        failing(json!({ "not": { "type": "string" } }), json!("a")).await,
        at("#", "not")
    );
    passes(json!(true), json!(1)).await;
    assert_eq!(
        failing(json!(false), json!(1)).await,
        at("#", "falseSchema")
    );
    assert_eq!(
        failing(json!({ "properties": { "a": false } }), json!({ "a": 1 })).await,
        at("/a", "falseSchema")
    );
    let three = json!({ "required": ["a", "b", "c"] });
    let limited = errors_with(three.clone(), json!({}), json!({ "max_errors": 2 }))
        .await
        .unwrap();
    assert_eq!(limited.len(), 2);
    assert_eq!(errors(three, json!({})).await.unwrap().len(), 3);
    let root = errors(json!({ "type": "string" }), json!(1)).await.unwrap();
    assert!(root[0].starts_with("#: "), "{root:?}");
}

// PEER-CASES J32
#[tokio::test]
async fn format_is_an_annotation_and_unknown_keywords_are_ignored() {
    passes(
        json!({ "type": "string", "format": "email", "weird": 1 }),
        json!("not-an-email"),
    )
    .await;
}

// PEER-CASES J37, J38, J39, J40, J41
#[tokio::test]
async fn a_tool_style_schema_is_checked_and_messages_name_what_was_expected() {
    let tool = json!({
        "type": "object",
        "properties": { "city": { "type": "string" }, "days": { "type": "integer" } },
        "required": ["city"],
    });
    passes(tool.clone(), json!({ "city": "BJ", "days": 3 })).await;
    assert_eq!(
        failing(tool.clone(), json!({ "days": 3 })).await,
        at("#", "required")
    );
    assert_eq!(
        failing(tool, json!({ "city": "BJ", "days": "3" })).await,
        at("/days", "type")
    );
    let weather = json!({ "properties": { "c": { "type": "string", "enum": ["晴", "阴"] } } });
    let said = errors(weather, json!({ "c": "晴朗" }))
        .await
        .unwrap()
        .concat();
    assert!(
        said.contains("晴\"") && said.contains("阴") && said.contains("晴朗"),
        "{said}"
    );
    let said = errors(json!({ "const": "fixed" }), json!("other"))
        .await
        .unwrap()
        .concat();
    assert!(said.contains("fixed"), "{said}");
    let said = errors(json!({ "pattern": "^[0-9]+$" }), json!("abc"))
        .await
        .unwrap()
        .concat();
    assert!(said.contains("^[0-9]+$"), "{said}");
    let said = errors(json!({ "required": ["age"] }), json!({}))
        .await
        .unwrap()
        .concat();
    assert!(said.contains("age"), "{said}");
}

#[tokio::test]
async fn the_full_validator_enforces_what_the_peers_subset_ignored() {
    let referenced = json!({ "$defs": { "n": { "type": "integer" } }, "properties": { "x": { "$ref": "#/$defs/n" } } });
    assert_eq!(
        failing(referenced, json!({ "x": "one" })).await,
        at("/x", "type")
    );
    let patterned = json!({ "patternProperties": { "^n_": { "type": "number" } } });
    assert_eq!(
        failing(patterned, json!({ "n_a": "x" })).await,
        at("/n_a", "type")
    );
    let conditional = json!({ "if": { "properties": { "kind": { "const": "a" } } }, "then": { "required": ["a"] } });
    assert_eq!(
        failing(conditional, json!({ "kind": "a" })).await,
        at("#", "required")
    );
}

#[tokio::test]
async fn schema_validation_refuses_a_bad_schema_or_configuration_at_load() {
    for (config, says) in [
        (json!({ "schema": { "type": "strin" } }), "schema:"),
        (json!({ "schema": { "pattern": "(" } }), "schema:"),
        (json!({}), "missing field `schema`"),
        (json!({ "schema": {}, "max_errors": 0 }), "max_errors"),
        (json!({ "schema": {}, "codefence": false }), "unknown field"),
    ] {
        let error = refused("schema_validation", "schema-validation", config).await;
        assert!(error.to_string().contains(says), "{error}");
    }
}
