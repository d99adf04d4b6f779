// agentry's permission gate for Pi. Pi itself never asks before it acts; with this
// extension loaded it asks the host (agentry, over the RPC extension UI sub-protocol)
// before each `write`, `edit` and `bash` tool call, while the agent's mode is `ask`.
//
// The mode is read, on every call, from the file named by AGENTRY_PI_GATE_FILE: `ask`
// asks, `full-access` lets every call run. A missing or unreadable file means `ask`, so
// the gate fails closed. The dialog's `message` is a JSON marker that tells agentry which
// tool call the question is about; its `title` is for people.
import { readFileSync } from "node:fs";

const GATED = new Set(["write", "edit", "bash"]);

function mode(): string {
  const file = process.env.AGENTRY_PI_GATE_FILE;
  if (!file) return "ask";
  try {
    return readFileSync(file, "utf8").trim() || "ask";
  } catch {
    return "ask";
  }
}

function describe(tool: string, input: any): string {
  if (tool === "bash") return `Run \`${String(input?.command ?? "")}\`?`;
  const verb = tool === "write" ? "Write" : "Edit";
  return `${verb} ${String(input?.path ?? "a file")}?`;
}

export default function agentryGate(pi: any) {
  pi.on("tool_call", async (event: any, ctx: any) => {
    if (!GATED.has(event.toolName) || mode() === "full-access") return undefined;
    if (!ctx.hasUI) {
      return { block: true, reason: "No one can approve this tool call." };
    }
    const marker = JSON.stringify({
      agentry_gate: 1,
      toolCallId: event.toolCallId,
      toolName: event.toolName,
    });
    const allowed = await ctx.ui.confirm(describe(event.toolName, event.input), marker, {
      signal: ctx.signal,
    });
    if (allowed) return undefined;
    return { block: true, reason: "The user denied this tool call." };
  });
}
