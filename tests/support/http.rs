//! The HTTP/1.1 the fake servers share: one accept loop ([`Server`]), one request reader
//! (the body by `Content-Length` or chunked), a JSON answer and one SSE writer ([`Sse`]).
//! One request per connection (`connection: close`); each fake keeps only its protocol's
//! routes and shapes.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A server on 127.0.0.1 that hands each request, with its connection, to a handler; it
/// stops when dropped.
pub struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// Listen on a free port; every connection's request goes to `handle`, each in a task
    /// of its own (a streamed answer does not hold up the next request).
    pub async fn start<H, F>(handle: H) -> Self
    where
        H: Fn(Request, TcpStream) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = std::sync::Arc::new(handle);
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let handle = handle.clone();
                tokio::spawn(async move {
                    if let Some(request) = Request::read(&mut stream).await {
                        handle(request, stream).await;
                    }
                });
            }
        });
        Self { addr, task }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A request as read: its line, headers and body.
#[derive(Debug, Clone)]
pub struct Request {
    /// `POST /v1/messages?beta=true HTTP/1.1` without the version: `POST /v1/messages?beta=true`.
    pub line: String,
    pub method: String,
    /// The target as sent, with its query.
    pub target: String,
    /// The target without its query.
    pub path: String,
    /// Header names in lower case, with their values.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    async fn read(stream: &mut TcpStream) -> Option<Self> {
        let (head, body) = read_request(stream).await?;
        let mut lines = head.lines();
        let mut first = lines.next().unwrap_or_default().split_whitespace();
        let method = first.next().unwrap_or_default().to_owned();
        let target = first.next().unwrap_or_default().to_owned();
        let path = target.split('?').next().unwrap_or_default().to_owned();
        let headers = lines
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            })
            .collect();
        Some(Self {
            line: format!("{method} {target}"),
            method,
            target,
            path,
            headers,
            body,
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (`null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// Answer `body` as `200 application/json`.
pub async fn respond_json(stream: &mut TcpStream, body: &Value) {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.flush().await;
}

/// Answer an empty `status` (`200 OK`, `404 Not Found`).
pub async fn respond_empty(stream: &mut TcpStream, status: &str) {
    let head = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = stream.write_all(head.as_bytes()).await;
}

/// A `text/event-stream` answer, written event by event, each flushed as it is sent; a
/// write fails once the client is gone.
pub struct Sse {
    stream: TcpStream,
}

impl Sse {
    /// Send the response head.
    pub async fn start(mut stream: TcpStream) -> std::io::Result<Self> {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n";
        stream.write_all(head.as_bytes()).await?;
        Ok(Self { stream })
    }

    /// One event: `event: <name>` when it has one, and its `data` (one line).
    pub async fn send(&mut self, name: Option<&str>, data: &str) -> std::io::Result<()> {
        let frame = match name {
            Some(name) => format!("event: {name}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        };
        self.stream.write_all(frame.as_bytes()).await?;
        self.stream.flush().await
    }

    /// An unnamed event with JSON `data`.
    pub async fn data(&mut self, data: &Value) -> std::io::Result<()> {
        self.send(None, &data.to_string()).await
    }

    /// An event named `name` with JSON `data`.
    pub async fn event(&mut self, name: &str, data: &Value) -> std::io::Result<()> {
        self.send(Some(name), &data.to_string()).await
    }

    /// Wait `delay` (not at all when zero) before the next event.
    pub async fn pause(&self, delay: Duration) {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }

    /// Keep the response open, never finishing it, until the client goes away.
    pub async fn stall(mut self) {
        let mut sink = [0u8; 256];
        while let Ok(n) = self.stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    }

    /// End the response: the connection closes.
    pub async fn end(mut self) -> std::io::Result<()> {
        self.stream.shutdown().await
    }
}

/// `text` in up to `n` pieces, at char boundaries; none for an empty text.
pub fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(n.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

/// A request head and its body, by `Content-Length` or chunked.
pub async fn read_request(stream: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut rest = buf[head_end + 4..].to_vec();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while rest.len() < len {
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        return Some((head, rest));
    }
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(pos) = rest.windows(2).position(|w| w == b"\r\n") {
                    break pos;
                }
                let n = stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                rest.extend_from_slice(&chunk[..n]);
            };
            let size_text = String::from_utf8_lossy(&rest[..line_end]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
            rest.drain(..line_end + 2);
            while rest.len() < size + 2 {
                let n = stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                rest.extend_from_slice(&chunk[..n]);
            }
            if size == 0 {
                return Some((head, body));
            }
            body.extend_from_slice(&rest[..size]);
            rest.drain(..size + 2);
        }
    }
    Some((head, rest))
}
