"""The component's exports, bound to the filter given to ``export``.

``from shallot_filter.exports import *`` in the ``app`` module is what
componentize-py builds the component from.
"""

import json

from wit_world import exports
from wit_world.exports import plugin
try:
    # A filter built with wasi:http (for outgoing HTTP), whose own `types`
    # is HTTP's: ours is named shallot_types (writing-filters-python.md).
    from wit_world.imports import shallot_types as types
except ImportError:
    from wit_world.imports import types

import shallot_filter as _sdk

__all__ = ["Plugin", "ChatFilter", "ToolFilter", "TurnFilter", "SystemPromptFilter", "TokenFilter"]

_FCTX = _sdk.Fctx()


class Plugin(exports.Plugin):
    def configure(self, config: str) -> None:
        _sdk._configure(config)

    def describe(self) -> plugin.Descriptor:
        f = _sdk._current()
        return plugin.Descriptor(
            name=f.name,
            version=f.version,
            init_fctx=json.dumps(f.init_fctx()),
            hooks=_sdk._live_hooks(f),
        )


class ChatFilter(exports.ChatFilter):
    def around_chat(self, request: types.ChatRequest) -> types.ChatResponse:
        return _sdk._guarded(_sdk._current().around_chat, request, _FCTX)


class ToolFilter(exports.ToolFilter):
    def around_tool(self, request: types.ToolRequest) -> types.ToolResponse:
        return _sdk._guarded(_sdk._current().around_tool, request, _FCTX)


class TurnFilter(exports.TurnFilter):
    def around_turn(self, request: types.TurnRequest) -> types.TurnResult:
        _sdk._begin_hook()
        try:
            return _sdk._returned_turn(_sdk._current().around_turn(request, _FCTX))
        except _sdk.FilterError as e:
            return types.TurnResult_Error(e._to_wit())


class SystemPromptFilter(exports.SystemPromptFilter):
    def system_prompt(self, prompt: str) -> str:
        return _sdk._guarded(_sdk._current().system_prompt, prompt)


class TokenFilter(exports.TokenFilter):
    pass
