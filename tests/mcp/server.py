"""An MCP server on the official Python SDK (`mcp`, pinned in
tests/gateway/requirements.txt), for shallot's MCP tests: tools that work,
tools that fail, hang, flood, write garbage or kill the server, a tool that
reports its progress, tools that change
the list of tools (or say so when nothing changed); resources, a resource
template and prompts. Over stdio; with
`--http PORT`, over streamable HTTP on 127.0.0.1:PORT at /mcp."""

import os
import sys

import anyio
from mcp import types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("shallot-test")


@server.tool()
def echo(text: str) -> str:
    """Says the text back."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def fail(why: str) -> str:
    """Always fails, saying why."""
    raise ToolError(why)


@server.tool()
async def hang() -> str:
    """Never answers."""
    await anyio.sleep(3600)
    return "late"


@server.tool()
async def linger(path: str) -> str:
    """Never answers; when the call is cancelled, writes `cancelled` to `path`."""
    try:
        await anyio.sleep(3600)
    except anyio.get_cancelled_exc_class():
        with open(path, "w") as told:
            told.write("cancelled")
        raise
    return "late"


@server.tool()
def die() -> str:
    """Ends the server's process in the middle of the call."""
    os._exit(3)


@server.tool()
def huge(kib: int) -> str:
    """Answers with `kib` KiB of text."""
    return "x" * (kib * 1024)


@server.tool()
def shout(times: int) -> str:
    """Writes `times` KiB to stderr without a newline, then answers."""
    for _ in range(times):
        sys.stderr.write("y" * 1024)
    sys.stderr.flush()
    return "done"


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The value of the HTTP request's header `name` (empty over stdio)."""
    return (ctx.headers or {}).get(name.lower(), "")


@server.tool()
def garble(lines: int) -> str:
    """Writes `lines` lines that are not JSON-RPC to stdout, then answers."""
    for _ in range(lines):
        sys.stdout.write('{"jsonrpc": "2.0", "id": "nobody asked"} and then not JSON\n')
    sys.stdout.flush()
    return "garbled"


@server.tool()
async def grow(name: str, ctx: Context) -> str:
    """Adds a tool `name` (it says its name) and says the tools changed."""

    def added() -> str:
        return f"I am {name}"

    server.add_tool(added, name=name, description="Added by grow.")
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


@server.tool()
async def churn(times: int, ctx: Context) -> str:
    """Says `times` times that the tools changed, none having changed."""
    for _ in range(times):
        await ctx.session.send_tool_list_changed()
    return "churned"


@server.tool()
async def report(times: int, ctx: Context, pause_ms: int = 0) -> str:
    """Reports its progress `times` times (1 to `times` of `times`), `pause_ms` apart and before its answer."""
    for n in range(1, times + 1):
        await ctx.report_progress(n, times, f"step {n}")
        await anyio.sleep(pause_ms / 1000)
    return f"reported {times}"


@server.tool()
async def touch(uri: str, ctx: Context) -> str:
    """Says the resource `uri` was updated."""
    await ctx.session.send_resource_updated(uri)
    return f"touched {uri}"


@server.tool()
async def ask_model(prompt: str, ctx: Context) -> str:
    """Asks the client's model (`sampling/createMessage`) and says what it answered."""
    asked = [types.SamplingMessage(role="user", content=types.TextContent(type="text", text=prompt))]
    answer = await ctx.session.create_message(asked, max_tokens=50)
    return f"the model said: {answer.content.text}"


@server.tool()
async def chatty(ctx: Context) -> str:
    """Logs a line at info and one at error, naming a secret, then answers."""
    await ctx.info("starting with SECRET-5")
    await ctx.error("failed with SECRET-6")
    return "chatted"


@server.resource("test://notes/public", mime_type="text/plain")
def public_notes() -> str:
    """Notes anyone may read; they name a secret the gateway redacts."""
    return "the door code is SECRET-1234"


@server.resource("test://notes/private", mime_type="text/plain")
def private_notes() -> str:
    """Notes only some keys may read."""
    return "private"


@server.resource("test://rooms/{room}", mime_type="text/plain")
def room(room: str) -> str:
    """A room, by its name."""
    return f"room {room}"


@server.prompt()
def greet(name: str) -> str:
    """Greets `name`, with a secret the gateway redacts."""
    return f"Hello {name}, your code is SECRET-42"


@server.prompt()
def plain() -> str:
    """A prompt with no arguments."""
    return "plain words"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
