#!/usr/bin/env python3
"""A scripted ACP agent for the sandbox tests: each prompt's text is run as a shell
command in the agent's working directory, and what it printed comes back as the
assistant's message, starting with `exit=<code>` (`exit=signal:<n>` when a signal ended
it). It needs no model: the tests say exactly what to run, as an injected prompt would.

Configured as `[providers.<id>] extends = "acp"`, `command = ["python3", "<this file>"]`.
`session/cancel` ends the running command's whole process group.

It takes HTTP MCP servers; the URL and bearer token of the one named `agentry` (the
server's own, given to every agent) reach each command as `EXEC_AGENT_MCP_URL` and
`EXEC_AGENT_MCP_TOKEN`, as an agent's MCP client would use them.

With `--announce` it also announces modes and models in its `session/new` and
`session/load` answers, as codex-acp does, takes `session/set_mode` and
`session/set_model` for those only, and runs each command with the session's mode and
model in `EXEC_AGENT_MODE` and `EXEC_AGENT_MODEL`.
"""

import json
import os
import signal
import subprocess
import sys
import threading

out_lock = threading.Lock()
running = {}  # session id -> Popen
ANNOUNCE = "--announce" in sys.argv[1:]
MODES = [
    {"id": "ask", "name": "Ask", "description": "Asks before it changes anything"},
    {"id": "code", "name": "Code", "description": "Changes files without asking"},
    {"id": "plan", "name": "Plan"},
]
MODELS = [
    {"modelId": "small", "name": "Small", "description": "Quick"},
    {"modelId": "large", "name": "Large"},
]
state = {}  # session id -> {"mode": ..., "model": ...}
agentry = {}  # session id -> {"url": ..., "token": ...}


def remember_agentry(session, servers):
    for server in servers or []:
        if server.get("name") != "agentry" or server.get("type") != "http":
            continue
        token = ""
        for header in server.get("headers") or []:
            if header.get("name", "").lower() == "authorization":
                token = header.get("value", "").removeprefix("Bearer ")
        agentry[session] = {"url": server.get("url", ""), "token": token}


def announced(session):
    current = state.setdefault(session, {"mode": "ask", "model": "small"})
    return {
        "modes": {"currentModeId": current["mode"], "availableModes": MODES},
        "models": {"currentModelId": current["model"], "availableModels": MODELS},
    }


def send(msg):
    line = json.dumps(msg)
    with out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def reply(req_id, result):
    send({"jsonrpc": "2.0", "id": req_id, "result": result})


def error(req_id, code, message):
    send({"jsonrpc": "2.0", "id": req_id, "error": {"code": code, "message": message}})


def run_prompt(req_id, session, text):
    env = None
    if session in agentry:
        env = dict(os.environ)
        env["EXEC_AGENT_MCP_URL"] = agentry[session]["url"]
        env["EXEC_AGENT_MCP_TOKEN"] = agentry[session]["token"]
    if ANNOUNCE:
        current = state.get(session, {})
        env = env or dict(os.environ)
        env["EXEC_AGENT_MODE"] = current.get("mode", "")
        env["EXEC_AGENT_MODEL"] = current.get("model", "")
    try:
        proc = subprocess.Popen(
            ["sh", "-c", text],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        say(session, f"exit=spawn-error\n{e}")
        reply(req_id, {"stopReason": "end_turn"})
        return
    running[session] = proc
    output, _ = proc.communicate()
    running.pop(session, None)
    code = proc.returncode
    status = f"signal:{-code}" if code < 0 else str(code)
    text = output.decode("utf-8", "replace")
    if len(text) > 64_000:
        text = text[:64_000] + "\n[truncated]"
    say(session, f"exit={status}\n{text}")
    reply(req_id, {"stopReason": "cancelled" if getattr(proc, "canceled", False) else "end_turn"})


def say(session, text):
    send(
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {
                "sessionId": session,
                "update": {
                    "sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": text},
                },
            },
        }
    )


def main():
    sessions = 0
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        method = msg.get("method")
        req_id = msg.get("id")
        params = msg.get("params") or {}
        if method == "initialize":
            reply(
                req_id,
                {
                    "protocolVersion": 1,
                    "agentCapabilities": {"loadSession": ANNOUNCE, "mcpCapabilities": {"http": True}},
                    "agentInfo": {"name": "exec-agent", "version": "1"},
                    "authMethods": [],
                },
            )
        elif method == "session/new":
            sessions += 1
            session = f"exec-{os.getpid()}-{sessions}"
            answer = {"sessionId": session}
            remember_agentry(session, params.get("mcpServers"))
            if ANNOUNCE:
                answer.update(announced(session))
            reply(req_id, answer)
        elif method == "session/load" and ANNOUNCE:
            remember_agentry(params.get("sessionId"), params.get("mcpServers"))
            reply(req_id, announced(params.get("sessionId")))
        elif method == "session/set_mode" and ANNOUNCE:
            mode = params.get("modeId")
            if any(m["id"] == mode for m in MODES):
                state.setdefault(params.get("sessionId"), {"mode": "ask", "model": "small"})
                state[params.get("sessionId")]["mode"] = mode
                reply(req_id, {})
            else:
                error(req_id, -32602, f"no mode {mode}")
        elif method == "session/set_model" and ANNOUNCE:
            model = params.get("modelId")
            if any(m["modelId"] == model for m in MODELS):
                state.setdefault(params.get("sessionId"), {"mode": "ask", "model": "small"})
                state[params.get("sessionId")]["model"] = model
                reply(req_id, {})
            else:
                error(req_id, -32602, f"no model {model}")
        elif method == "session/set_mode" or method == "session/set_model":
            reply(req_id, {})
        elif method == "session/prompt":
            text = "".join(
                b.get("text", "") for b in params.get("prompt", []) if b.get("type") == "text"
            )
            threading.Thread(
                target=run_prompt, args=(req_id, params.get("sessionId"), text), daemon=True
            ).start()
        elif method == "session/cancel":
            proc = running.get(params.get("sessionId"))
            if proc is not None:
                proc.canceled = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
        elif req_id is not None and method is not None:
            error(req_id, -32601, f"{method} is not supported")


if __name__ == "__main__":
    main()
