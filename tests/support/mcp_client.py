"""Drives agentry's /mcp endpoint with the reference MCP client (the `mcp` package from
PyPI, pinned in .ci/install-test-peers): lists the tools, opens a mock agent that asks for
a permission, waits for it, answers, waits again, reads its timeline, reads another team's
agent and archives its own; then makes a workspace, has a second agent write a file in
it, reads the diff, prompts it again and interrupts it. Prints one JSON object with what each step answered; the Rust
test (tests/api/mcp.rs) makes the assertions.

Environment: MCP_CLIENT_URL, MCP_CLIENT_TOKEN, PROJECT_ID, WORKSPACE_ID,
FOREIGN_AGENT_ID.
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
            out["protocol_version"] = client.protocol_version
            out["server_name"] = client.server_info.name if client.server_info else None
            listed = await client.list_tools()
            out["tools"] = [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in listed.tools]
            await client.send_ping()

            created = result(
                await client.call_tool(
                    "create_agent",
                    {
                        "workspace_id": os.environ["WORKSPACE_ID"],
                        "provider": "mock",
                        "title": "asks first",
                        "labels": {"via": "mcp"},
                        "prompt": "/ask deploy?",
                    },
                )
            )
            out["create_agent"] = created
            agent = created["structured"]["id"]
            out["wait_asking"] = result(await client.call_tool("wait_for_agent", {"agent_id": agent, "timeout_s": 30}))
            pending = out["wait_asking"]["structured"]["pending_permissions"]
            request = pending[0]["request_id"] if pending else "perm_missing"
            out["answer_permission"] = result(
                await client.call_tool(
                    "answer_permission", {"agent_id": agent, "request_id": request, "behavior": "allow"}
                )
            )
            out["wait_done"] = result(await client.call_tool("wait_for_agent", {"agent_id": agent, "timeout_s": 30}))
            out["get_timeline"] = result(await client.call_tool("get_timeline", {"agent_id": agent, "limit": 1000}))
            out["foreign_timeline"] = result(
                await client.call_tool("get_timeline", {"agent_id": os.environ["FOREIGN_AGENT_ID"]})
            )
            out["bad_arguments"] = result(
                await client.call_tool("send_message", {"agent_id": agent, "txt": "typo"})
            )
            out["archive_agent"] = result(await client.call_tool("archive_agent", {"agent_id": agent}))
            out["agent_id"] = agent

            # A second agent in a workspace made by the tools: it writes a file (the diff
            # shows it), then sleeps until it is interrupted.
            out["list_providers"] = result(await client.call_tool("list_providers", {}))
            made = result(
                await client.call_tool("create_workspace", {"project_id": os.environ["PROJECT_ID"], "title": "via mcp"})
            )
            out["create_workspace"] = made
            workspace = made["structured"]["id"]
            out["list_workspaces"] = result(await client.call_tool("list_workspaces", {"limit": 10}))
            writer = result(
                await client.call_tool(
                    "create_agent",
                    {"workspace_id": workspace, "provider": "mock", "prompt": "/write notes.txt hello"},
                )
            )
            second = writer["structured"]["id"]
            out["wait_written"] = result(await client.call_tool("wait_for_agent", {"agent_id": second, "timeout_s": 30}))
            out["get_diff"] = result(await client.call_tool("get_diff", {"workspace_id": workspace}))
            out["send_message"] = result(
                await client.call_tool("send_message", {"agent_id": second, "text": "/sleep 60000"})
            )
            out["interrupt_agent"] = result(await client.call_tool("interrupt_agent", {"agent_id": second}))
            out["wait_interrupted"] = result(
                await client.call_tool("wait_for_agent", {"agent_id": second, "timeout_s": 30})
            )
    json.dump(out, sys.stdout)


asyncio.run(main())
