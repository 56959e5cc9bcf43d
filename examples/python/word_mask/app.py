"""A token transformer in Python with state and flush: masks listed words in
the streamed answer, even when a word arrives split across tokens. It holds
back the last, possibly unfinished word of each step and emits it with the
next one, or at the end of the stream (flush).

Configuration: {"words": ["darn", "heck"], "mask": "*"}
"""

import re

from shallot_filter import Filter, TokenTransform, export
from shallot_filter.exports import *  # noqa: F401,F403


class WordMask(Filter):
    name = "word-mask-py"
    version = "0.1.0"

    def __init__(self, config):
        config = config or {}
        unknown = set(config) - {"words", "mask"}
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
        words = config.get("words", [])
        if not all(isinstance(w, str) and w for w in words):
            raise ValueError("words must be non-empty strings")
        self.mask = config.get("mask", "*")
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE) if words else None

    def token_transform(self):
        return Masker(self)


class Masker(TokenTransform):
    def __init__(self, config):
        self.config = config
        self.held = ""

    def _masked(self, text):
        pattern = self.config.pattern
        if pattern is None:
            return text
        return pattern.sub(lambda m: self.config.mask * len(m.group(0)), text)

    def step(self, tokens, out):
        for text, meta in tokens:
            text = self.held + text
            # Everything up to the last word boundary is final; the rest may
            # still grow.
            cut = max(text.rfind(" "), text.rfind("\n")) + 1
            self.held = text[cut:]
            if cut:
                out.push(self._masked(text[:cut]), meta)

    def flush(self, out):
        if self.held:
            out.push(self._masked(self.held))
            self.held = ""


export(WordMask)
