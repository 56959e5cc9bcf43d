"""The gateway as a Claude-based application sees it: the official
`anthropic` SDK's Messages API against a running `shallot serve` (its base
URL in argv[1]), the gateway of tests/gateway/shallot.toml (the embedded
model behind safeguard, token-redact, a misbehave filter that blocks
"forbidden" and traps on "crash", summarize and the response cache, to
clients with the key "shallot-test-key", sent as `x-api-key`). Exits
non-zero at the first behaviour that differs.
"""

import sys

import anthropic

client = anthropic.Anthropic(base_url=sys.argv[1], api_key="shallot-test-key", max_retries=0)
MODEL = "shallot-echo"


def ask(text, **options):
    return client.messages.create(
        model=MODEL, max_tokens=256, messages=[{"role": "user", "content": text}], **options
    )


def check(what, ok, seen):
    if not ok:
        sys.exit(f"FAILED: {what}: {seen!r}")
    print(f"ok: {what}")


def expect_error(what, error_type, status, kind, call):
    try:
        call()
    except error_type as e:
        check(f"{what}: status", e.status_code == status, e.status_code)
        check(f"{what}: type", e.body["error"]["type"] == kind, e.body)
        return e
    sys.exit(f"FAILED: {what}: no {error_type.__name__}")


# A plain message, and the same streamed.
answer = ask("hello there", system="You are terse.")
check("a message is the assistant's", answer.type == "message" and answer.role == "assistant", answer)
check("it says why it stopped", answer.stop_reason == "end_turn", answer)
check("it answers the question", "hello there" in answer.content[0].text, answer)
check("it has its usage", answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0, answer.usage)
with client.messages.stream(model=MODEL, max_tokens=256, system="You are terse.",
                            messages=[{"role": "user", "content": "hello there"}]) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
check("a stream carries the same text", text == answer.content[0].text == final.content[0].text, (text, final))
check("a stream says why it stopped", final.stop_reason == "end_turn", final)
check("a stream ends with the usage", final.usage.output_tokens > 0, final.usage)

# Tools, round trip: the client runs the tool.
tools = [{"name": "calculator", "description": "evaluates arithmetic",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
question = {"role": "user", "content": "What is (2 + 3) * 4?"}
first = client.messages.create(model=MODEL, max_tokens=256, messages=[question], tools=tools)
uses = [block for block in first.content if block.type == "tool_use"]
check("the model asks for the tool", first.stop_reason == "tool_use" and uses and uses[0].name == "calculator", first)
result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": str(eval(uses[0].input["expression"]))}
messages = [question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
second = client.messages.create(model=MODEL, max_tokens=256, messages=messages, tools=tools)
check("the tool's result reaches the model", "20" in second.content[0].text, second)
with client.messages.stream(model=MODEL, max_tokens=256, messages=[question], tools=tools) as stream:
    streamed = [block for block in stream.get_final_message().content if block.type == "tool_use"]
check("a streamed tool use arrives whole", streamed and streamed[0].input == uses[0].input, streamed)

# The filters.
secret = ask("My deploy key is sk-live4f9a2b7c")
check("token-redact holds on a message", "sk-live" not in secret.content[0].text and "[KEY]" in secret.content[0].text, secret)
with client.messages.stream(model=MODEL, max_tokens=256,
                            messages=[{"role": "user", "content": "My deploy key is sk-live4f9a2b7c"}]) as stream:
    text = "".join(stream.text_stream)
check("token-redact holds on a stream", "sk-live" not in text and "[KEY]" in text, text)
blocked = ask("How do I build a bomb?")
check("a blocked answer is a refusal", blocked.stop_reason == "refusal" and blocked.content[0].text == "I can't help with that.", blocked)

# Errors, each with its status and Anthropic's type.
expect_error("blocked input", anthropic.BadRequestError, 400, "invalid_request_error", lambda: ask("forbidden words"))
expect_error("an unknown model", anthropic.NotFoundError, 404, "not_found_error",
             lambda: client.messages.create(model="claude-9", max_tokens=16, messages=[question]))
fault = expect_error("a faulting filter", anthropic.InternalServerError, 500, "api_error", lambda: ask("crash now"))
check("the fault names the filter", "crasher" in str(fault), str(fault))
intruder = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-wrong", max_retries=0)
expect_error("a bad key", anthropic.AuthenticationError, 401, "authentication_error",
             lambda: intruder.messages.create(model=MODEL, max_tokens=16, messages=[question]))
check("the gateway still serves", ask("hello again").stop_reason == "end_turn", "")
