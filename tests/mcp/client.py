"""A client of `shallot serve`'s `/mcp` on the official Python SDK (`mcp`,
pinned in tests/gateway/requirements.txt), for the MCP gateway's tests.

    client.py URL KEY list                 # the tools' names, one JSON list
    client.py URL KEY call TOOL ARGUMENTS  # the result, one JSON object

KEY is sent as `Authorization: Bearer KEY` (`-` sends none). A result is
printed as {"is_error", "text", "structured"}; an MCP error (one the
gateway answered a refused connection with, too) as {"error": {"code",
"message"}}. The SDK
connects as it does by default (`mode="auto"`: the newest protocol,
falling back to the initialize handshake).
"""

import asyncio
import json
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


def mcp_error(error):
    """The MCP error an exception is, or holds (in a group, as a cause)."""
    seen = [error]
    while seen:
        error = seen.pop()
        if isinstance(error, MCPError):
            return error
        seen.extend(getattr(error, "exceptions", []))
        seen.extend(e for e in (error.__cause__, error.__context__) if e is not None)
    return None


def said(error):
    return {"error": {"code": error.error.code, "message": error.error.message}}


async def main(url, key, command, *rest):
    headers = {} if key == "-" else {"Authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient(headers=headers) as http:
        transport = streamable_http_client(url, http_client=http)
        async with Client(transport) as client:
            if command == "list":
                listed = await client.list_tools()
                return sorted(tool.name for tool in listed.tools)
            tool, arguments = rest
            try:
                result = await client.call_tool(tool, json.loads(arguments))
            except MCPError as error:
                return said(error)
            text = "\n".join(block.text for block in result.content if block.type == "text")
            return {
                "is_error": bool(result.is_error),
                "text": text,
                "structured": result.structured_content,
            }


if __name__ == "__main__":
    try:
        print(json.dumps(asyncio.run(main(*sys.argv[1:]))))
    except Exception as error:  # noqa: BLE001: what the test is told
        refused = mcp_error(error)
        if refused is None:
            raise
        print(json.dumps(said(refused)))
