//! Test guest: a stateless filter written as one function, with no
//! configuration type and no serde of its own. It answers a question that
//! mentions "secret" itself and passes every other to the model, marking
//! the answer.

use shallot_guest::{ChatRequest, ChatResponse, FilterError, FinishReason, Next};

#[shallot_guest::around_chat(name = "one-function")]
fn guard(request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
    if request
        .messages()
        .iter()
        .any(|m| m.text().contains("secret"))
    {
        return Ok(ChatResponse::from_text(
            "blocked",
            FinishReason::ContentFiltered,
        ));
    }
    let answer = next.chat(request)?;
    answer.set_text(&format!("checked: {}", answer.text()));
    Ok(answer)
}
