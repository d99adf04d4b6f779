//! The bench's REST client: what a CI bot or a dashboard does over HTTP, nothing more.

use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::event_stream::Parser;

#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            client: reqwest::Client::builder()
                .tcp_nodelay(true)
                .build()
                .expect("a default HTTP client"),
            base: base.to_owned(),
            token: token.to_owned(),
        }
    }

    /// POST a JSON body; the status and the body as JSON.
    pub async fn post(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        let res = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        let status = res.status().as_u16();
        let body = res.json().await.unwrap_or(Value::Null);
        Ok((status, body))
    }

    /// POST and require a 2xx answer.
    pub async fn post_ok(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let (status, v) = self.post(path, body).await?;
        anyhow::ensure!(
            (200..300).contains(&status),
            "POST {path} answered {status}: {v}"
        );
        Ok(v)
    }

    /// PUT a JSON body and require a 2xx answer.
    pub async fn put_ok(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let res = self
            .client
            .put(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .with_context(|| format!("PUT {path}"))?;
        let status = res.status();
        let v: Value = res.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status.is_success(), "PUT {path} answered {status}: {v}");
        Ok(v)
    }

    pub async fn get_ok(&self, path: &str) -> anyhow::Result<Value> {
        let res = self
            .client
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        let status = res.status();
        let v: Value = res.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status.is_success(), "GET {path} answered {status}: {v}");
        Ok(v)
    }

    /// Open an MCP session at `/mcp`; its `Mcp-Session-Id`.
    pub async fn mcp_session(&self) -> anyhow::Result<String> {
        let res = self
            .client
            .post(format!("{}/mcp", self.base))
            .bearer_auth(&self.token)
            .json(
                &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "agentry-bench", "version": env!("CARGO_PKG_VERSION")}}}),
            )
            .send()
            .await
            .context("POST /mcp initialize")?;
        anyhow::ensure!(
            res.status().is_success(),
            "initialize answered {}",
            res.status()
        );
        let session = res
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .context("initialize answered no Mcp-Session-Id")?
            .to_owned();
        Ok(session)
    }

    /// Call an MCP tool; its result, which must not be a tool error.
    pub async fn mcp_call(
        &self,
        session: &str,
        name: &str,
        arguments: &Value,
    ) -> anyhow::Result<Value> {
        let res = self
            .client
            .post(format!("{}/mcp", self.base))
            .bearer_auth(&self.token)
            .header("Mcp-Session-Id", session)
            .header("MCP-Protocol-Version", "2025-06-18")
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": name, "arguments": arguments}}))
            .send()
            .await
            .with_context(|| format!("tools/call {name}"))?;
        let v: Value = res.json().await?;
        anyhow::ensure!(
            v["result"]["isError"] == false,
            "tools/call {name} answered {v}"
        );
        Ok(v["result"].clone())
    }

    /// Open an SSE stream (`after` becomes `Last-Event-ID`).
    pub async fn stream(&self, path: &str, after: Option<i64>) -> anyhow::Result<SseStream> {
        let mut req = self
            .client
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(after) = after {
            req = req.header("Last-Event-ID", after.to_string());
        }
        let res = req.send().await.with_context(|| format!("GET {path}"))?;
        anyhow::ensure!(
            res.status().is_success(),
            "GET {path} answered {}",
            res.status()
        );
        Ok(SseStream {
            res,
            frames: Parser::new(),
        })
    }

    /// A project on the bench's repository and one directory workspace in it.
    pub async fn workspace(&self, repo: &std::path::Path) -> anyhow::Result<String> {
        let project = self
            .post_ok("/v1/projects", &json!({"name": "bench", "repo_path": repo}))
            .await?;
        let ws = self
            .post_ok(
                "/v1/workspaces",
                &json!({"project_id": project["id"], "kind": "directory"}),
            )
            .await?;
        Ok(ws["id"].as_str().context("workspace id")?.to_owned())
    }

    /// Create `n` mock agents (without a prompt), `concurrency` requests at a time, and
    /// wait until each one's session has started.
    pub async fn open_agents(
        &self,
        workspace: &str,
        n: usize,
        concurrency: usize,
    ) -> anyhow::Result<Vec<String>> {
        let body = json!({"workspace_id": workspace, "provider": "mock"});
        let created: Vec<anyhow::Result<String>> = futures::stream::iter(0..n)
            .map(|_| async {
                let a = self.post_ok("/v1/agents", &body).await?;
                let id = a["id"].as_str().context("agent id")?.to_owned();
                let w = self
                    .get_ok(&format!("/v1/agents/{id}/wait?timeout_s=120"))
                    .await?;
                anyhow::ensure!(w["status"] == "idle", "agent {id} did not start: {w}");
                Ok(id)
            })
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;
        created.into_iter().collect()
    }

    /// Send a prompt to every agent at once.
    pub async fn prompt_all(&self, agents: &[String], text: &str) -> anyhow::Result<()> {
        let body = json!({"text": text});
        let sent = futures::stream::iter(agents)
            .map(|a| {
                let body = &body;
                async move {
                    self.post_ok(&format!("/v1/agents/{a}/messages"), body)
                        .await
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await;
        for r in sent {
            r?;
        }
        Ok(())
    }
}

/// An open SSE response, read frame by frame.
pub struct SseStream {
    res: reqwest::Response,
    frames: Parser,
}

impl SseStream {
    /// The next chunk of bytes the server sent, as the `data` of the events it
    /// completes; `None` when the stream ended. Fails after `timeout` without any byte.
    pub async fn next_chunk(&mut self, timeout: Duration) -> anyhow::Result<Option<Vec<Vec<u8>>>> {
        let chunk = tokio::time::timeout(timeout, self.res.chunk())
            .await
            .map_err(|_| anyhow::anyhow!("no byte from the stream for {timeout:?}"))??;
        Ok(chunk.map(|bytes| {
            self.frames
                .push(&bytes)
                .into_iter()
                .map(|event| event.data.into_bytes())
                .collect()
        }))
    }
}
