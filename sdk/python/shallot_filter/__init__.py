"""shallot-filter: write a shallot filter in Python.

Subclass :class:`Filter`, override the hooks you need (the others pass
through and are never called), then export it::

    from shallot_filter import Filter, FilterError, next
    from shallot_filter.exports import *  # the component's exports

    class Guard(Filter):
        name = "guard"

        def __init__(self, config):
            self.word = (config or {}).get("word", "secret")

        def around_chat(self, request, fctx):
            if any(self.word in text_of(m) for m in request.messages()):
                raise FilterError("content-filtered", "blocked")
            return next.chat(request)

    export(Guard)

Build it with ``componentize-py`` against shallot's ``wit/`` (see
docs/book/writing-filters-python.md): the module must be called ``app`` and this SDK must be on the
path. A hook gets the host-owned request (``request.messages()``,
``request.set_messages(...)``, ...) and the filter's private context
``fctx``; JSON values travel as Python values. Raise :class:`FilterError`
to fail a request on purpose; any other exception is a fault: the host
reports it with the traceback and discards the instance.
"""

import json
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

from componentize_py_types import Err
from wit_world.imports import context as _context
from wit_world.imports import fctx as _fctx
from wit_world.imports import kv as _kv
from wit_world.imports import log as _log
from wit_world.imports import metrics as _metrics
from wit_world.imports import model as _model
from wit_world.imports import next as _next
try:
    # A filter built with wasi:http (for outgoing HTTP), whose own `types`
    # is HTTP's: ours is named shallot_types (writing-filters-python.md).
    from wit_world.imports import shallot_types as types
except ImportError:
    from wit_world.imports import types

__all__ = [
    "Filter",
    "FilterError",
    "Fctx",
    "TokenTransform",
    "TokenOut",
    "context",
    "export",
    "kv",
    "log",
    "metrics",
    "model",
    "next",
    "text_of",
    "types",
]


class FilterError(Exception):
    """A typed failure: raise it from a hook to fail the request; ``next``
    raises it when an inner layer failed.

    ``kind`` is one of ``transient``, ``timeout``, ``content-filtered``,
    ``invalid-request``, ``auth``, ``not-found``, ``limit-exceeded``,
    ``plugin-fault``, ``internal``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        # Set on an inner failure: which ``next`` call raised it and what it
        # said, so that re-raising it unchanged keeps its origin.
        self._inner: Optional[Tuple[int, str, str]] = None

    @staticmethod
    def _from_wit(error: types.FilterError, nth: int) -> "FilterError":
        e = FilterError(error.kind.name.lower().replace("_", "-"), error.message)
        e._inner = (nth, e.kind, e.message)
        return e

    def _to_wit(self) -> types.FilterError:
        if self._inner is not None and self._inner[1:] == (self.kind, self.message):
            _next.pass_on(self._inner[0])
        return types.FilterError(types.ErrorKind[self.kind.upper().replace("-", "_")], self.message)


class Fctx:
    """The filter's private context in the current invoke: one JSON value,
    the same in its around-turn, around-chat and around-tool."""

    def get(self) -> Any:
        return json.loads(_fctx.get())

    def set(self, state: Any) -> None:
        _fctx.set(json.dumps(state))

    def update(self, change: Callable[[Any], Any]) -> Any:
        """Sets the state to ``change(state)`` and returns it."""
        state = change(self.get())
        self.set(state)
        return state


class _Context:
    """The invoke's shared context: JSON values by key, seen by every filter."""

    def get(self, key: str, default: Any = None) -> Any:
        value = _context.get(key)
        return default if value is None else json.loads(value)

    def set(self, key: str, value: Any) -> None:
        _context.set(key, json.dumps(value))

    def remove(self, key: str) -> None:
        _context.remove(key)

    def keys(self) -> List[str]:
        return _context.keys()


class _Log:
    """Log lines, attributed to the filter by the host."""

    def trace(self, message: str) -> None:
        _log.log(_log.Level.TRACE, message)

    def debug(self, message: str) -> None:
        _log.log(_log.Level.DEBUG, message)

    def info(self, message: str) -> None:
        _log.log(_log.Level.INFO, message)

    def warn(self, message: str) -> None:
        _log.log(_log.Level.WARN, message)

    def error(self, message: str) -> None:
        _log.log(_log.Level.ERROR, message)


# Calls through ``next`` in the current hook call, counted as the host counts
# them; and the failed turn results they returned, by call.
_calls = 0
_turn_errors: List[Tuple[int, Any]] = []


def _begin_hook() -> None:
    global _calls
    _calls = 0
    _turn_errors.clear()


def _count() -> int:
    global _calls
    _calls += 1
    return _calls


def _inner(call: Callable[..., Any], *args: Any) -> Any:
    nth = _count()
    try:
        return call(*args)
    except Err as e:
        raise FilterError._from_wit(e.value, nth) from None


def _inner_turn(call: Callable[..., Any], *args: Any) -> Any:
    nth = _count()
    result = call(*args)
    if isinstance(result, types.TurnResult_Error):
        _turn_errors.append((nth, result))
    return result


def _returned_turn(result: Any) -> Any:
    """A turn result a hook returns: a failure ``next`` returned, handed back
    as it is, keeps its origin."""
    for nth, failed in _turn_errors:
        if result is failed:
            _next.pass_on(nth)
    return result


class _Next:
    """The inner layers. An inner failure raises :class:`FilterError`."""

    def chat(self, request: types.ChatRequest, timeout_ms: Optional[int] = None) -> types.ChatResponse:
        if timeout_ms is None:
            return _inner(_next.chat, request)
        return _inner(_next.chat_within, request, timeout_ms)

    def tool(self, request: types.ToolRequest, timeout_ms: Optional[int] = None) -> types.ToolResponse:
        if timeout_ms is None:
            return _inner(_next.tool, request)
        return _inner(_next.tool_within, request, timeout_ms)

    def turn(self, request: types.TurnRequest, timeout_ms: Optional[int] = None) -> types.TurnResult:
        """Turn results (done, interrupt, error) are values, never raised."""
        if timeout_ms is None:
            return _inner_turn(_next.turn, request)
        return _inner_turn(_next.turn_within, request, timeout_ms)


def _granted(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except Err as e:
        raise FilterError(e.value.kind.name.lower().replace("_", "-"), e.value.message) from None


class _Kv:
    """Shared state kept across invokes (granted by ``grants.kv``): keys in
    this filter's namespace, in the store the operator chose (in-process,
    an SQLite file, or a Redis several hosts share). A key is 1 to 512
    bytes, a value at most 1 MiB; a ``ttl_ms`` of 0 keeps a key until it is
    deleted. A refusal, or a store that fails, raises ``FilterError``."""

    def get(self, key: str) -> Optional[Tuple[str, int]]:
        """The key's value and version; ``None`` for a key never written,
        deleted or expired."""
        entry = _granted(_kv.get, key)
        return None if entry is None else (entry.value, entry.version)

    def set(self, key: str, value: str, ttl_ms: int = 0) -> int:
        """Writes ``value``; its new version."""
        return _granted(_kv.set, key, value, ttl_ms)

    def swap(self, key: str, value: str, version: int, ttl_ms: int = 0) -> Optional[int]:
        """Writes ``value`` only if the key is still at ``version`` (0:
        absent), atomically: the new version, or ``None`` with nothing
        written."""
        return _granted(_kv.swap, key, value, version, ttl_ms)

    def add(self, key: str, delta: int = 1, ttl_ms: int = 0) -> Tuple[int, int]:
        """Adds ``delta`` to the counter atomically (absent: 0); a counter
        this creates lives ``ttl_ms``. The count and its time left (ms)."""
        count = _granted(_kv.add, key, delta, ttl_ms)
        return (count.value, count.ttl_ms)

    def delete(self, key: str) -> bool:
        """Forgets the key; whether it was there."""
        return _granted(_kv.delete, key)

    def take(self, windows: List[Tuple[str, Union[str, Tuple[str, int]], int, int]]) -> Tuple[bool, List[Tuple[int, int, int]]]:
        """Counts in several windows at once, all or nothing, on the
        store's clock: each window's amount is added only if none had
        counted its limit yet. A window is ``(key, period, limit,
        amount)``, its period ``("fixed", ms)``, ``("sliding", ms)``,
        ``("aligned", ms)`` or ``"month"``. Whether it was admitted, and
        each window's ``(used, reset_ms, ends_ms)``."""
        taken = _granted(
            _kv.take,
            [_kv.Window(key, _period(period), limit, amount) for key, period, limit, amount in windows],
        )
        return (taken.admitted, [(w.used, w.reset_ms, w.ends_ms) for w in taken.windows])

    def settle(self, key: str, period: Union[str, Tuple[str, int]], ends_ms: int, delta: int) -> Optional[int]:
        """Adds ``delta`` to the counter of the window a take saw end at
        ``ends_ms``, only while it lives and never below 0: the counter
        after, or ``None`` when the window had ended."""
        return _granted(_kv.settle, key, _period(period), ends_ms, delta)


def _period(period: Union[str, Tuple[str, int]]):
    """A window's period as the host takes it."""
    if period == "month":
        return _kv.Period_Month()
    kind, ms = period
    cases = {"fixed": _kv.Period_Fixed, "sliding": _kv.Period_Sliding, "aligned": _kv.Period_Aligned}
    if kind not in cases:
        raise ValueError(f"a period is fixed, sliding, aligned or month, not {kind!r}")
    return cases[kind](ms)


class _Metrics:
    """Counters and histograms of this filter's own, on the gateway's
    ``/metrics`` as ``shallot_gateway_plugin_<filter>__<name>`` (no grant
    needed). A metric keeps the kind and label names of its first use; at
    most 32 metrics, 4 labels and 64 series a metric (more series count in
    the one labelled ``other``). A refusal raises ``FilterError``."""

    def count(self, name: str, labels: Optional[dict] = None, value: int = 1) -> None:
        """Adds ``value`` to the counter ``name`` in the series ``labels``."""
        _granted(_metrics.count, name, list((labels or {}).items()), value)

    def observe(self, name: str, value: float, labels: Optional[dict] = None) -> None:
        """Records ``value`` in the histogram ``name`` (buckets 0.005 to 10)."""
        _granted(_metrics.observe, name, list((labels or {}).items()), value)


class _Model:
    """Side calls to the model the operator grants (``grants.model``),
    outside the onion: no filter sees them, nothing of them is streamed.
    Bounded per hook call in calls and tokens (``FilterError``
    ``limit-exceeded`` past either)."""

    def complete(self, request: types.ChatRequest) -> types.ChatResponse:
        """The granted model's answer to ``request``."""
        return _granted(_model.complete, request)


context = _Context()
kv = _Kv()
metrics = _Metrics()
model = _Model()
log = _Log()
next = _Next()


def text_of(message: types.Message) -> str:
    """A message's text, parts joined."""
    content = message.content
    if isinstance(content, types.Content_Text):
        return content.value
    if isinstance(content, types.Content_Parts):
        return "".join(p.value for p in content.value if isinstance(p, types.ContentPart_Text))
    return ""


def assistant(text: str) -> types.Message:
    """An assistant message with ``text``."""
    return types.Message(types.Role.ASSISTANT, types.Content_Text(text), [], None)


def answer(text: str, reason: types.FinishReason = types.FinishReason.COMPLETE) -> types.ChatResponse:
    """A response with ``text``, for a filter that answers itself (a
    refusal, a cached answer) instead of calling ``next.chat``."""
    return types.ChatResponse(assistant(text), reason)


class TokenOut:
    """What a token transform emits: tokens, each with optional metadata
    (a JSON object as text)."""

    def __init__(self) -> None:
        self._parts: List[bytes] = []
        self._ends: List[int] = []
        self._metas: List[types.TokenMeta] = []
        self._len = 0

    def push(self, text: str, meta: Optional[str] = None) -> None:
        if meta is not None:
            self._metas.append(types.TokenMeta(index=len(self._ends), json=meta))
        raw = text.encode("utf-8")
        self._parts.append(raw)
        self._len += len(raw)
        self._ends.append(self._len)

    def _batch(self) -> types.TokenBatch:
        return types.TokenBatch(text=b"".join(self._parts).decode("utf-8"), ends=self._ends, metas=self._metas)


def _tokens(batch: types.TokenBatch) -> Iterator[Tuple[str, Optional[str]]]:
    raw = batch.text.encode("utf-8")
    metas = {m.index: m.json for m in batch.metas}
    start = 0
    for i, end in enumerate(batch.ends):
        yield raw[start:end].decode("utf-8"), metas.get(i)
        start = end


class TokenTransform:
    """One stream's token transform; keep per-stream state on ``self``."""

    def step(self, tokens: List[Tuple[str, Optional[str]]], out: TokenOut) -> None:
        """Takes the next ``(text, meta)`` tokens and emits 0..N for them
        (drop, pass, expand, or buffer for a later step or ``flush``)."""
        for text, meta in tokens:
            out.push(text, meta)

    def flush(self, out: TokenOut) -> None:
        """The stream ended normally: emit what is still buffered. Not called
        when the stream fails, so buffered tokens never leak then."""


class Filter:
    """A shallot filter. The constructor gets the operator's configuration
    (parsed JSON, ``None`` when none is given); raise ``ValueError`` to
    reject it. Every hook passes through until overridden, and only
    overridden hooks are called by the host."""

    name = "filter"
    version = "0.1.0"

    def __init__(self, config: Any) -> None:
        if config is not None:
            raise ValueError(f"{type(self).__name__} takes no configuration")

    def init_fctx(self) -> Any:
        """The private context's seed for every invoke."""
        return None

    def wants(self, hook: str) -> bool:
        """Whether an overridden hook is live for this configuration
        (``around-chat``, ``around-tool``, ``around-turn``,
        ``token-transform``, ``system-prompt``); all are by default."""
        return True

    def around_chat(self, request: types.ChatRequest, fctx: Fctx) -> types.ChatResponse:
        return next.chat(request)

    def around_tool(self, request: types.ToolRequest, fctx: Fctx) -> types.ToolResponse:
        return next.tool(request)

    def around_turn(self, request: types.TurnRequest, fctx: Fctx) -> types.TurnResult:
        return next.turn(request)

    def system_prompt(self, prompt: str) -> str:
        return prompt

    def token_transform(self) -> TokenTransform:
        """A fresh transform for one stream."""
        return TokenTransform()


_HOOKS = {
    "around_chat": "AROUND_CHAT",
    "around_tool": "AROUND_TOOL",
    "around_turn": "AROUND_TURN",
    "token_transform": "TOKEN_TRANSFORM",
    "system_prompt": "SYSTEM_PROMPT",
}

_exported: Optional[type] = None
_filter: Optional[Filter] = None


def export(cls: type) -> type:
    """Makes ``cls`` (a :class:`Filter` subclass) the component's filter."""
    global _exported
    _exported = cls
    return cls


def _current() -> Filter:
    if _filter is None:
        raise RuntimeError("the host called a hook before configure")
    return _filter


def _configure(config: str) -> None:
    global _filter
    if _exported is None:
        raise Err("no filter exported: call shallot_filter.export(YourFilter) in app.py")
    try:
        _filter = _exported(json.loads(config))
    except (ValueError, TypeError, KeyError) as e:
        raise Err(str(e)) from None


def _live_hooks(f: Filter) -> List[Any]:
    from wit_world.exports import plugin

    cls = type(f)
    return [
        getattr(plugin.Hook, hook)
        for name, hook in _HOOKS.items()
        if getattr(cls, name) is not getattr(Filter, name) and f.wants(hook.lower().replace("_", "-"))
    ]


def _guarded(call: Callable[..., Any], *args: Any) -> Any:
    _begin_hook()
    try:
        return call(*args)
    except FilterError as e:
        raise Err(e._to_wit()) from None
