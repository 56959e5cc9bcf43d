"""A client of `shallot serve`'s `/mcp` on the official Python SDK (`mcp`,
pinned in tests/gateway/requirements.txt), for the MCP gateway's tests.

    client.py URL KEY list                 # the tools' names, one JSON list
    client.py URL KEY call TOOL ARGUMENTS  # the result, one JSON object
    client.py URL KEY progress TOOL ARGS   # a call asking for its progress
    client.py URL KEY offers               # the prompts, resources and templates it lists
    client.py URL KEY prompt NAME ARGS     # a prompt's messages' text, or the error
    client.py URL KEY read URI             # a resource's text, or the error
    client.py URL KEY sample TOOL ARGS     # a call whose server asks the client's model
    client.py URL KEY logs TOOL LEVEL      # a call's log lines, at LEVEL or above (`-`: any)
    client.py URL KEY subscribe URI        # subscribes, has the server touch it, hears it
    client.py URL KEY subscribe-many N     # subscribes to N rooms: the first refusal
    client.py URL KEY watch                # the names, then again at each change
    client.py URL KEY watch-legacy         # the same over the initialize handshake

KEY is sent as `Authorization: Bearer KEY` (`-` sends none). A result is
printed as {"is_error", "text", "structured"} (with `progress`, also
"progress": what the call reported, in order); an MCP error (one the
gateway answered a refused connection with, too) as {"error": {"code",
"message"}}. The SDK
connects as it does by default (`mode="auto"`: the newest protocol,
falling back to the initialize handshake).

`watch` listens for `notifications/tools/list_changed` (the newest
protocol's `subscriptions/listen`), prints the names when the listen is
acknowledged and again after each change, one JSON list a line, and when
the gateway ends the listen {"ended": "closed"} (its graceful close) or
{"ended": "lost"}. `watch-legacy` connects with the initialize handshake
(`mode="legacy"`, as clients of the 2025 protocols do), where the
notifications come on the session's stream, and prints the names after
each until it is killed.
"""

import asyncio
import json
import sys

from mcp import Client, types
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost
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


async def names(client):
    return sorted(tool.name for tool in (await client.list_tools()).tools)


def show(line):
    print(json.dumps(line), flush=True)


async def watch(client):
    async with client.listen(tools_list_changed=True) as changes:
        show(await names(client))
        try:
            async for _ in changes:
                show(await names(client))
        except SubscriptionLost:
            return {"ended": "lost"}
    return {"ended": "closed"}


async def watch_legacy(transport):
    changed = asyncio.Queue()

    async def told(message):
        if isinstance(message, types.ToolListChangedNotification):
            await changed.put(message)

    async with Client(transport, mode="legacy", message_handler=told) as client:
        show(await names(client))
        while True:
            await changed.get()
            show(await names(client))


async def offers(client, command, *rest):
    """What `offers`, `prompt` and `read` print."""
    try:
        if command == "offers":
            return {
                "prompts": sorted(p.name for p in (await client.list_prompts()).prompts),
                "resources": sorted(r.uri for r in (await client.list_resources()).resources),
                "templates": sorted(
                    t.uri_template for t in (await client.list_resource_templates()).resource_templates
                ),
            }
        if command == "prompt":
            name, arguments = rest
            got = await client.get_prompt(name, json.loads(arguments))
            return {"messages": [m.content.text for m in got.messages]}
        (uri,) = rest
        read = await client.read_resource(uri)
        return {"contents": [c.text for c in read.contents]}
    except MCPError as error:
        return said(error)


async def subscribe(transport, command, arg):
    """What `subscribe` and `subscribe-many` print: over the initialize
    handshake, where a resource's updates come on the session's stream."""
    updated = asyncio.Queue()

    async def told(message):
        if isinstance(message, types.ResourceUpdatedNotification):
            await updated.put(str(message.params.uri))

    async with Client(transport, mode="legacy", message_handler=told) as client:
        try:
            if command == "subscribe-many":
                for n in range(int(arg)):
                    await client.subscribe_resource(f"test://rooms/r{n}")
                return {"subscribed": int(arg)}
            await client.subscribe_resource(arg)
            await client.call_tool("test_touch", {"uri": "test://notes/elsewhere"})
            await client.call_tool("test_touch", {"uri": arg})
            return {"updated": await asyncio.wait_for(updated.get(), 60)}
        except MCPError as error:
            return said(error)


async def sample(transport, tool, arguments):
    """What `sample` prints: the call's result, the client answering the
    server's sampling as a model would (it says back what it was asked)."""

    async def model(context, params):
        asked = params.messages[0].content.text
        return types.CreateMessageResult(
            role="assistant", content=types.TextContent(type="text", text=f"echo of {asked}"), model="client-model"
        )

    async with Client(transport, mode="legacy", sampling_callback=model) as client:
        result = await client.call_tool(tool, json.loads(arguments))
        text = "\n".join(block.text for block in result.content if block.type == "text")
        return {"is_error": bool(result.is_error), "text": text}


async def logs(transport, tool, level):
    """What `logs` prints: the log lines heard by the end of the call."""
    heard = []

    async def logged(params):
        heard.append({"level": params.level, "data": params.data})

    async with Client(transport, mode="legacy", logging_callback=logged) as client:
        if level != "-":
            await client.set_logging_level(level)
        await client.call_tool(tool, {})
        # A line the server sent as it answered may still be on its way.
        for _ in range(100):
            if len(heard) >= (2 if level == "-" else 1):
                break
            await asyncio.sleep(0.05)
        return {"heard": heard}


async def main(url, key, command, *rest):
    headers = {} if key == "-" else {"Authorization": f"Bearer {key}"}
    # The SDK's own client (30 s to connect, 300 s between reads of a
    # stream), not httpx's defaults: their 5 s read timeout cut a listen
    # whose stream was quiet longer than that on a busy machine.
    async with create_mcp_http_client(headers=headers) as http:
        transport = streamable_http_client(url, http_client=http)
        if command == "watch-legacy":
            return await watch_legacy(transport)
        if command in ("subscribe", "subscribe-many"):
            return await subscribe(transport, command, *rest)
        if command == "sample":
            return await sample(transport, *rest)
        if command == "logs":
            return await logs(transport, *rest)
        async with Client(transport) as client:
            if command == "list":
                return await names(client)
            if command == "watch":
                return await watch(client)
            if command in ("offers", "prompt", "read"):
                return await offers(client, command, *rest)
            tool, arguments = rest
            heard = []

            async def progressed(progress, total, message):
                heard.append({"progress": progress, "total": total, "message": message})

            asked = progressed if command == "progress" else None
            try:
                result = await client.call_tool(tool, json.loads(arguments), progress_callback=asked)
            except MCPError as error:
                return said(error)
            text = "\n".join(block.text for block in result.content if block.type == "text")
            answer = {
                "is_error": bool(result.is_error),
                "text": text,
                "structured": result.structured_content,
            }
            if command == "progress":
                answer["progress"] = heard
            return answer


if __name__ == "__main__":
    try:
        print(json.dumps(asyncio.run(main(*sys.argv[1:]))))
    except Exception as error:  # noqa: BLE001: what the test is told
        refused = mcp_error(error)
        if refused is None:
            raise
        print(json.dumps(said(refused)))
