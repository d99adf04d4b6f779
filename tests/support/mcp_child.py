"""Drives agentry's /mcp endpoint with an agent's own token, as the agent's MCP client
would (the `mcp` package from PyPI, pinned in .ci/install-test-peers): opens a child mock
agent in the agent's workspace, waits for it, prompts it again and waits, then tries to open one in another team's
workspace and one more child past the limits. Prints one JSON object with what each call
answered; the Rust test (tests/api/tree.rs) makes the assertions.

Environment: MCP_CLIENT_URL, MCP_CLIENT_TOKEN, WORKSPACE_ID, FOREIGN_WORKSPACE_ID.
"""

import asyncio
import json
import os
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def result(r):
    return {
        "is_error": bool(r.is_error),
        "text": "\n".join(c.text for c in r.content if getattr(c, "type", "") == "text"),
        "structured": r.structured_content,
    }


async def main():
    url = os.environ["MCP_CLIENT_URL"]
    token = os.environ["MCP_CLIENT_TOKEN"]
    out = {}
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            child = result(
                await client.call_tool(
                    "create_agent",
                    {
                        "workspace_id": os.environ["WORKSPACE_ID"],
                        "provider": "mock",
                        "title": "child",
                        "prompt": "hello from the parent",
                    },
                )
            )
            out["create_child"] = child
            if not child["is_error"]:
                agent = child["structured"]["id"]
                await client.call_tool("wait_for_agent", {"agent_id": agent, "timeout_s": 30})
                out["send_message"] = result(
                    await client.call_tool("send_message", {"agent_id": agent, "text": "and again"})
                )
                out["wait_child"] = result(
                    await client.call_tool("wait_for_agent", {"agent_id": agent, "timeout_s": 30})
                )
            out["create_foreign"] = result(
                await client.call_tool(
                    "create_agent",
                    {"workspace_id": os.environ["FOREIGN_WORKSPACE_ID"], "provider": "mock"},
                )
            )
            out["create_second"] = result(
                await client.call_tool(
                    "create_agent", {"workspace_id": os.environ["WORKSPACE_ID"], "provider": "mock"}
                )
            )
    json.dump(out, sys.stdout)


asyncio.run(main())
