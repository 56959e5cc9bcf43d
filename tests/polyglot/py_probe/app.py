"""Test guest: the Rust probe's core behaviours, in Python, so one onion can
mix languages. Configuration (all optional):

- tag: appends "<tag>_before" / "<tag>_after" to the context list "trace"
- hooks: the live hooks ("chat", "tool", "turn", "tokens"); all by default
- short_circuit: answers "short:<tag>" without calling next
- calls: calls next this many times (retry)
- count: counts hook calls in FCtx "n" and copies FCtx to context "fctx:<tag>"
- prefix: token transform: prefixes each token
- batch: token transform: one token per this many, the rest on flush
- fault: "chat", "tool" or "tokens": raises an unexpected exception there
- mimic: raises its own FilterError just like an inner failure, instead of
  letting the inner one through
- kv_count: in around-chat, adds 1 to this kv counter and writes the count,
  and the version a get then reads, to context "kv:<tag>"
- metric: in around-chat, counts 1 in this metric, labelled lang="py"
- fetch: in around-chat, GETs this URL with componentize-py's poll_loop
  (over wasi:http) and writes "<status> <body>" to context "fetched:<tag>"
"""

import asyncio
from urllib.parse import urlsplit

import poll_loop
from wit_world.imports.types import Fields, OutgoingRequest, Scheme_Http, Scheme_Https

from shallot_filter import Filter, FilterError, TokenTransform, context, export, kv, metrics, next, types
from shallot_filter.exports import *  # noqa: F401,F403

_HOOK_NAMES = {"around-chat": "chat", "around-tool": "tool", "around-turn": "turn", "token-transform": "tokens"}


class Probe(Filter):
    name = "py-probe"

    def __init__(self, config):
        config = config or {}
        unknown = set(config) - {"tag", "hooks", "short_circuit", "calls", "count", "prefix", "batch", "fault", "mimic", "kv_count", "fetch", "metric"}
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
        self.tag = config.get("tag", "")
        self.hooks = config.get("hooks")
        self.short_circuit = config.get("short_circuit", False)
        self.calls = max(config.get("calls", 1), 1)
        self.count = config.get("count", False)
        self.prefix = config.get("prefix")
        self.batch = config.get("batch")
        self.fault = config.get("fault")
        self.mimic = config.get("mimic", False)
        self.kv_count = config.get("kv_count")
        self.fetch = config.get("fetch")
        self.metric = config.get("metric")

    def wants(self, hook):
        return self.hooks is None or _HOOK_NAMES.get(hook) in self.hooks

    def _push(self, item):
        trace = context.get("trace", [])
        trace.append(item)
        context.set("trace", trace)

    def _before(self, fctx):
        if self.tag:
            self._push(f"{self.tag}_before")
        if self.count:
            fctx.update(lambda s: {**(s or {}), "n": (s or {}).get("n", 0) + 1})

    def _after(self, fctx):
        if self.tag:
            self._push(f"{self.tag}_after")
            if self.count:
                context.set(f"fctx:{self.tag}", fctx.get())

    def around_chat(self, request, fctx):
        if self.fault == "chat":
            raise RuntimeError("py-probe: fault in around_chat")
        self._before(fctx)
        if self.kv_count:
            count, _ = kv.add(self.kv_count, 1, 60_000)
            _, version = kv.get(self.kv_count)
            key, period = f"{self.kv_count}:taken", ("fixed", 60_000)
            admitted, seen = kv.take([(key, period, 2, 1)])
            settled = kv.settle(key, period, seen[0][2], 0)
            context.set(
                f"kv:{self.tag}",
                {"count": count, "version": version, "admitted": admitted, "settled": settled},
            )
        if self.metric:
            metrics.count(self.metric, {"lang": "py"})
        if self.fetch:
            loop = poll_loop.PollLoop()
            asyncio.set_event_loop(loop)
            context.set(f"fetched:{self.tag}", loop.run_until_complete(_get(self.fetch)))
        if self.short_circuit:
            message = types.Message(types.Role.ASSISTANT, types.Content_Text(f"short:{self.tag}"), [], None)
            response = types.ChatResponse(message, types.FinishReason.COMPLETE)
        else:
            for _ in range(self.calls):
                try:
                    response = next.chat(request)
                except FilterError as e:
                    if self.mimic:
                        raise FilterError(e.kind, e.message) from None
                    raise
        self._after(fctx)
        return response

    def around_tool(self, request, fctx):
        if self.fault == "tool":
            raise RuntimeError("py-probe: fault in around_tool")
        self._before(fctx)
        if self.short_circuit:
            response = types.ToolResponse(f'"short:{self.tag}"')
        else:
            for _ in range(self.calls):
                response = next.tool(request)
        self._after(fctx)
        return response

    def around_turn(self, request, fctx):
        self._before(fctx)
        result = next.turn(request)
        self._after(fctx)
        return result

    def token_transform(self):
        return Tokens(self.prefix or "", self.batch, self.fault == "tokens")


class Tokens(TokenTransform):
    def __init__(self, prefix, batch, fault):
        self.prefix = prefix
        self.batch = batch
        self.fault = fault
        self.held = []

    def step(self, tokens, out):
        if self.fault:
            raise RuntimeError("py-probe: fault in a token step")
        for text, meta in tokens:
            if self.batch:
                self.held.append(text)
                if len(self.held) == self.batch:
                    out.push(self.prefix + "".join(self.held), meta)
                    self.held = []
            else:
                out.push(self.prefix + text, meta)

    def flush(self, out):
        if self.held:
            out.push(self.prefix + "".join(self.held))
            self.held = []


export(Probe)


async def _get(url):
    """GETs `url`; "<status> <body>"."""
    parts = urlsplit(url)
    request = OutgoingRequest(Fields.from_list([]))
    request.set_scheme(Scheme_Https() if parts.scheme == "https" else Scheme_Http())
    request.set_authority(parts.netloc)
    request.set_path_with_query(parts.path + (f"?{parts.query}" if parts.query else ""))
    response = await poll_loop.send(request)
    status = response.status()
    stream = poll_loop.Stream(response.consume())
    body = b""
    while (chunk := await stream.next()) is not None:
        body += chunk
    return f"{status} {body.decode()}"
