"""The gateway as an application sees it: the official `openai` SDK against
a running `shallot serve` (base URL in argv[1], serving `shallot-echo` with
safeguard, token-redact, a misbehave filter that blocks "forbidden" and
traps on "crash", summarize and the response cache, to clients with the key
"shallot-test-key"; and `shallot-forgetful`, the same without a store for
the Responses API). Chat completions, embeddings, then the Responses API. Exits non-zero at the first behaviour that differs.
"""

import base64
import json
import struct
import sys
import urllib.request

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="shallot-test-key", max_retries=0)
MODEL = "shallot-echo"
# The same filters and model, keeping no Responses API responses.
FORGETFUL = "shallot-forgetful"


def ask(text, **options):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **options
    )


def check(what, ok, seen):
    if not ok:
        sys.exit(f"FAILED: {what}: {seen!r}")
    print(f"ok: {what}")


def expect_error(what, error_type, status, code, call):
    try:
        call()
    except error_type as e:
        check(f"{what}: status", e.status_code == status, e.status_code)
        if code is not None:
            check(f"{what}: code", e.code == code, e.body)
        return e
    sys.exit(f"FAILED: {what}: no {error_type.__name__}")


# A plain completion.
answer = ask("hello there")
check("a completion has one choice", len(answer.choices) == 1, answer)
check("it is the assistant's", answer.choices[0].message.role == "assistant", answer)
check("it finished", answer.choices[0].finish_reason == "stop", answer)
check("its usage adds up", answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens, answer.usage)

# Streamed, with usage.
stream = ask("hello there", stream=True, stream_options={"include_usage": True})
chunks = list(stream)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("a stream carries the same text", text == answer.choices[0].message.content, (text, answer))
check("a stream ends with the usage", chunks[-1].usage is not None and chunks[-1].choices == [], chunks[-1])
check("a stream says why it finished", any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks), chunks)

# Tool calls, round trip: the client runs the tool.
tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
messages = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
call = first.choices[0].message.tool_calls[0]
check("the model asks for the tool", call.function.name == "calculator" and first.choices[0].finish_reason == "tool_calls", first)
arguments = json.loads(call.function.arguments)
messages.append(first.choices[0].message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(arguments["expression"]))})
second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
check("the tool's result reaches the model", "20" in second.choices[0].message.content, second)
streamed = list(client.chat.completions.create(model=MODEL, messages=messages[:1], tools=tools, stream=True))
calls = [c for c in streamed if c.choices and c.choices[0].delta.tool_calls]
check("a streamed tool call arrives whole", calls and calls[0].choices[0].delta.tool_calls[0].function.name == "calculator", streamed)

# The filters.
secret = ask("My deploy key is sk-live4f9a2b7c")
check("token-redact holds on the JSON answer", "sk-live" not in secret.choices[0].message.content, secret)
text = "".join(c.choices[0].delta.content or "" for c in ask("My deploy key is sk-live4f9a2b7c", stream=True) if c.choices)
check("token-redact holds on the stream", "sk-live" not in text and "[KEY]" in text, text)
blocked = ask("How do I build a bomb?")
check("a blocked answer is an answer", blocked.choices[0].finish_reason == "content_filter", blocked)

# Errors, each with its status.
expect_error("blocked input", openai.BadRequestError, 400, "content_filter", lambda: ask("forbidden words"))
expect_error("an unknown model", openai.NotFoundError, 404, "model_not_found",
             lambda: client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}]))
fault = expect_error("a faulting filter", openai.InternalServerError, 500, "plugin_fault", lambda: ask("crash now"))
check("the fault names the filter", "crasher" in str(fault), str(fault))
expect_error("a malformed message", openai.BadRequestError, 400, None,
             lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]))
intruder = openai.OpenAI(base_url=sys.argv[1], api_key="sk-wrong", max_retries=0)
expect_error("a bad key", openai.AuthenticationError, 401, "invalid_api_key",
             lambda: intruder.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]))
check("the gateway still serves", ask("hello again").choices[0].finish_reason == "stop", "")
check("the models list names the models", [m.id for m in client.models.list()] == [MODEL, FORGETFUL], "")
check("the model can be retrieved", client.models.retrieve(MODEL).id == MODEL, "")
expect_error("an unknown model", openai.NotFoundError, 404, "model_not_found", lambda: client.models.retrieve("gpt-9"))

# The cache: the same request again is answered from it, streamed too.
def raw(text, **options):
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **options
    )


first = raw("cache this answer")
check("a first answer is the model's", first.headers.get("x-shallot-cache") == "miss", dict(first.headers))
again = raw("cache this answer")
check("the same request again is the cache's", again.headers.get("x-shallot-cache") == "hit", dict(again.headers))
answer = first.parse().choices[0].message.content
check("with the same answer", again.parse().choices[0].message.content == answer, again.parse())
streamed = "".join(c.choices[0].delta.content or "" for c in ask("cache this answer", stream=True) if c.choices)
check("a cached answer streams", streamed == answer, streamed)
skipped = raw("cache this answer", extra_body={"cache": False})
check("a request can opt out", skipped.headers.get("x-shallot-cache") == "skip", dict(skipped.headers))

# Embeddings: the embedded model's vectors, through the gateway's key;
# the same text, the same vector, as numbers or base64.
vectors = client.embeddings.create(model=MODEL, input=["a cat", "a dog", "a cat"])
check("embeddings come back, one per input", [len(d.embedding) for d in vectors.data] == [16, 16, 16], vectors)
check("the same text, the same vector", vectors.data[0].embedding == vectors.data[2].embedding, vectors.data)
packed = client.embeddings.create(model=MODEL, input="a cat", encoding_format="base64")
raw = packed.data[0].embedding
floats = list(struct.unpack("<16f", base64.b64decode(raw))) if isinstance(raw, str) else raw
same = len(floats) == 16 and all(abs(a - b) < 1e-6 for a, b in zip(floats, vectors.data[0].embedding))
check("base64 embeddings decode to the same vector", same, raw)

# A long conversation: summarize replaces its older messages by a summary
# (a side call to the route's model), the answer is to the latest message,
# and the gateway's /metrics count the summary.
long = []
for n in range(6):
    long.append({"role": "user", "content": f"Question {n}: tell me about the number {n} at some length, please."})
    long.append({"role": "assistant", "content": f"The number {n} is a fine number, and there is a lot to say about it."})
long.append({"role": "user", "content": "and the last one"})
latest = client.chat.completions.create(model=MODEL, messages=long)
check("a summarized conversation answers its latest message", "and the last one" in latest.choices[0].message.content, latest)
with urllib.request.urlopen(sys.argv[1].removesuffix("/v1") + "/metrics") as response:
    metrics = response.read().decode()
summarized = 'shallot_gateway_plugin_summarize__summaries_total{filter="summarize",outcome="summarized"} 1'
check("the summary is counted in the filter's metric", summarized in metrics, [l for l in metrics.splitlines() if "summar" in l])

# The Responses API: plain and streamed, the same text.
reply = client.responses.create(model=MODEL, input="hello there")
check("a response is completed", reply.status == "completed" and "hello there" in reply.output_text, reply)
check("its usage adds up", reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens, reply.usage)
with client.responses.stream(model=MODEL, input="hello there") as stream:
    deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    final = stream.get_final_response()
check("a streamed response carries the same text", "".join(deltas) == final.output_text == reply.output_text, (deltas, final))

# Tools round trip, continued from the kept response with only the output.
rtools = [{"type": "function", "name": "calculator", "description": "evaluates arithmetic",
           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
first = client.responses.create(model=MODEL, input="What is (2 + 3) * 4?", tools=rtools)
calls = [item for item in first.output if item.type == "function_call"]
check("the model asks for the tool", calls and calls[0].name == "calculator", first)
result = str(eval(json.loads(calls[0].arguments)["expression"]))
output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}
second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=rtools, input=[output])
check("the kept response continues with the tool's result", "20" in second.output_text, second)
with client.responses.stream(model=MODEL, input="What is (2 + 3) * 4?", tools=rtools) as stream:
    streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
check("a streamed call arrives whole", streamed and json.loads(streamed[0].arguments) == json.loads(calls[0].arguments), streamed)
# Without a store, the client sends the whole conversation.
whole = [{"role": "user", "content": "What is (2 + 3) * 4?"}, calls[0].model_dump(exclude_none=True), output]
third = client.responses.create(model=FORGETFUL, store=False, tools=rtools, input=whole)
check("a whole conversation needs no store", "20" in third.output_text, third)
expect_error("previous_response_id without a store", openai.BadRequestError, 400, "store_not_configured",
             lambda: client.responses.create(model=FORGETFUL, previous_response_id=first.id, input="and then?"))
expect_error("an unknown previous response", openai.BadRequestError, 400, "previous_response_not_found",
             lambda: client.responses.create(model=MODEL, previous_response_id="resp_nothing", input="and then?"))

# The filters, in the Responses API's own shape.
secret = client.responses.create(model=MODEL, input="My deploy key is sk-live4f9a2b7c")
check("token-redact holds on a response", "sk-live" not in secret.output_text and "[KEY]" in secret.output_text, secret)
with client.responses.stream(model=MODEL, input="My deploy key is sk-live4f9a2b7c") as stream:
    text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
check("token-redact holds on a streamed response", "sk-live" not in text and "[KEY]" in text, text)
blocked = client.responses.create(model=MODEL, input="How do I build a bomb?")
check("a blocked response is incomplete, for the content filter",
      blocked.status == "incomplete" and blocked.incomplete_details.reason == "content_filter", blocked)
expect_error("blocked input", openai.BadRequestError, 400, "content_filter",
             lambda: client.responses.create(model=MODEL, input="forbidden words"))
