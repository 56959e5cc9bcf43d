"""The exported ``token-transformer`` resource. componentize-py looks for it
in a top-level module named after its interface, so it lives here rather
than in the ``shallot_filter`` package."""

from wit_world.exports import token_filter
from wit_world.imports import types

import shallot_filter as _sdk


class TokenTransformer(token_filter.TokenTransformer):
    def __init__(self) -> None:
        self._transform = _sdk._current().token_transform()

    def step(self, tokens: types.TokenBatch) -> types.TokenBatch:
        out = _sdk.TokenOut()
        _sdk._guarded(self._transform.step, list(_sdk._tokens(tokens)), out)
        return out._batch()

    def flush(self) -> types.TokenBatch:
        out = _sdk.TokenOut()
        _sdk._guarded(self._transform.flush, out)
        return out._batch()
