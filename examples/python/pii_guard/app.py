"""A chat filter in Python: rewrites e-mail addresses and phone numbers in
the user's messages before the model sees them, and counts what it replaced
in the response metadata.

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


export(PiiGuard)
