"""A chat and tool filter in Python: rewrites e-mail addresses and phone
numbers in the user's messages before the model sees them (and counts what
it replaced in the response metadata), and in every string of a tool call's
arguments before the tool gets them (an MCP server behind `/mcp` too).

Configuration (optional): {"email": "[EMAIL]", "phone": "[PHONE]"}
"""

import json
import re

from shallot_filter import Filter, export, log, next, types
from shallot_filter.exports import *  # noqa: F401,F403

EMAIL = re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)+")
PHONE = re.compile(r"\+?\d[\d ()-]{7,}\d")


class PiiGuard(Filter):
    name = "pii-guard-py"
    version = "0.1.0"

    def __init__(self, config):
        config = config or {}
        unknown = set(config) - {"email", "phone"}
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
        self.email = config.get("email", "[EMAIL]")
        self.phone = config.get("phone", "[PHONE]")

    def around_chat(self, request, fctx):
        replaced = 0
        messages = request.messages()
        for message in messages:
            if message.role == types.Role.USER and isinstance(message.content, types.Content_Text):
                text, emails = EMAIL.subn(self.email, message.content.value)
                text, phones = PHONE.subn(self.phone, text)
                replaced += emails + phones
                message.content = types.Content_Text(text)
        if replaced:
            request.set_messages(messages)
            log.info(f"replaced {replaced} piece(s) of personal data")
        response = next.chat(request)
        metadata = json.loads(response.metadata())
        metadata["pii_replaced"] = replaced
        response.set_metadata(json.dumps(metadata))
        return response

    def around_tool(self, request, fctx):
        arguments = json.loads(request.arguments())
        scrubbed = self._scrub(arguments)
        if scrubbed != arguments:
            request.set_arguments(json.dumps(scrubbed))
            log.info(f"rewrote personal data in the arguments of {request.name()}")
        return next.tool(request)

    def _scrub(self, value):
        if isinstance(value, str):
            return PHONE.sub(self.phone, EMAIL.sub(self.email, value))
        if isinstance(value, list):
            return [self._scrub(item) for item in value]
        if isinstance(value, dict):
            return {key: self._scrub(item) for key, item in value.items()}
        return value


export(PiiGuard)
