//! A JSON-RPC peer on a child's stdio: one message per line, our requests matched to
//! their responses by id, the peer's requests and notifications handed to the adapter
//! through a bounded channel (reading stops while it is full, which slows the child down
//! rather than buffering without bound), and the adapter's replies written back.
//!
//! The `"jsonrpc": "2.0"` member is optional on input; whether we send it is a choice of
//! the protocol (`PeerOptions::version_field`): Codex's app-server neither sends nor needs
//! it. Lines are read with the capped [`LineReader`]: an over-long line or one that is not
//! JSON becomes [`Incoming::Malformed`] and reading goes on. When the child's output ends
//! every waiting request fails with [`RpcError::Closed`] and the channel closes.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};

use super::framing::{FramingError, LineReader};
use super::lock;

/// A request id, ours or the peer's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RequestId {
    Number(i64),
    Text(String),
}

impl RequestId {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Number(n) => n.as_i64().map(Self::Number),
            Value::String(s) => Some(Self::Text(s.clone())),
            _ => None,
        }
    }

    pub fn to_value(&self) -> Value {
        match self {
            Self::Number(n) => json!(n),
            Self::Text(s) => json!(s),
        }
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Text(s) => f.write_str(s),
        }
    }
}

/// Why a request of ours got no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RpcError {
    /// The peer answered with an error object.
    #[error("{method} failed: {message} (code {code})")]
    Remote {
        method: String,
        code: i64,
        message: String,
        data: Option<Value>,
    },
    #[error("{method} got no answer within {} ms", after.as_millis())]
    Timeout { method: String, after: Duration },
    /// The connection ended (the process exited or closed its output) before an answer.
    #[error("the connection to the agent closed")]
    Closed,
}

/// What the peer sent that is not an answer to one of our requests.
#[derive(Debug)]
pub enum Incoming {
    /// A request: answer it with [`Peer::respond`] or [`Peer::respond_error`].
    Request {
        id: RequestId,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
        params: Value,
    },
    /// A line that could not be used (not JSON, not a message, too long); reading goes on.
    Malformed {
        error: String,
    },
}

#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Send `"jsonrpc": "2.0"` in every message.
    pub version_field: bool,
    /// How many incoming messages may wait for the adapter before reading pauses.
    pub capacity: usize,
    /// The longest line read.
    pub max_line: usize,
}

impl Default for PeerOptions {
    fn default() -> Self {
        Self {
            version_field: true,
            capacity: 256,
            max_line: super::framing::DEFAULT_MAX_LINE,
        }
    }
}

type Waiters = Arc<Mutex<Option<HashMap<i64, oneshot::Sender<Result<Value, RpcError>>>>>>;

/// Our end of the connection. Cheap to clone; every clone writes to the same peer.
#[derive(Clone)]
pub struct Peer {
    out: mpsc::Sender<Vec<u8>>,
    next_id: Arc<AtomicI64>,
    /// Requests waiting for an answer, by id; `None` once the connection has closed.
    waiters: Waiters,
    version_field: bool,
    closed: watch::Receiver<Option<String>>,
}

impl Peer {
    /// Start reading `reader` and writing `writer` in two tasks. Incoming requests and
    /// notifications arrive on the returned receiver, which closes when the input ends.
    pub fn start<R, W>(
        reader: R,
        writer: W,
        options: PeerOptions,
    ) -> (Self, mpsc::Receiver<Incoming>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(64);
        let (in_tx, in_rx) = mpsc::channel(options.capacity.max(1));
        let (closed_tx, closed_rx) = watch::channel(None);
        let waiters: Waiters = Arc::new(Mutex::new(Some(HashMap::new())));
        tokio::spawn(write_lines(writer, out_rx));
        tokio::spawn(read_lines(
            LineReader::with_max(reader, options.max_line),
            in_tx,
            waiters.clone(),
            closed_tx,
        ));
        let peer = Self {
            out: out_tx,
            next_id: Arc::new(AtomicI64::new(0)),
            waiters,
            version_field: options.version_field,
            closed: closed_rx,
        };
        (peer, in_rx)
    }

    /// Send a request and wait up to `timeout` for its result.
    pub async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, RpcError> {
        let pending = self.send_request(method, params).await?;
        let id = pending.id;
        match tokio::time::timeout(timeout, pending.result()).await {
            Ok(result) => result,
            Err(_) => {
                self.forget(id);
                Err(RpcError::Timeout {
                    method: method.to_owned(),
                    after: timeout,
                })
            }
        }
    }

    /// Send a request without waiting: its result comes through the returned handle.
    pub async fn send_request(&self, method: &str, params: Value) -> Result<Pending, RpcError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match lock(&self.waiters).as_mut() {
            Some(waiters) => waiters.insert(id, tx),
            None => return Err(RpcError::Closed),
        };
        let mut message = Map::new();
        message.insert("method".into(), json!(method));
        message.insert("id".into(), json!(id));
        message.insert("params".into(), params);
        if let Err(e) = self.send(message).await {
            self.forget(id);
            return Err(e);
        }
        Ok(Pending {
            id,
            method: method.to_owned(),
            rx,
        })
    }

    pub async fn notify(&self, method: &str, params: Option<Value>) -> Result<(), RpcError> {
        let mut message = Map::new();
        message.insert("method".into(), json!(method));
        if let Some(params) = params {
            message.insert("params".into(), params);
        }
        self.send(message).await
    }

    /// Answer a request of the peer.
    pub async fn respond(&self, id: &RequestId, result: Value) -> Result<(), RpcError> {
        let mut message = Map::new();
        message.insert("id".into(), id.to_value());
        message.insert("result".into(), result);
        self.send(message).await
    }

    /// Answer a request of the peer with an error.
    pub async fn respond_error(
        &self,
        id: &RequestId,
        code: i64,
        message: &str,
    ) -> Result<(), RpcError> {
        let mut reply = Map::new();
        reply.insert("id".into(), id.to_value());
        reply.insert("error".into(), json!({"code": code, "message": message}));
        self.send(reply).await
    }

    /// Whether the connection has closed (the input ended or the writer failed).
    pub fn is_closed(&self) -> bool {
        self.closed.borrow().is_some() || self.out.is_closed()
    }

    /// Resolves once the input has ended, with why (`None` for a plain end of input).
    pub async fn closed(&self) -> Option<String> {
        let mut closed = self.closed.clone();
        match closed.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().filter(|r| !r.is_empty()),
            Err(_) => None,
        }
    }

    fn forget(&self, id: i64) {
        if let Some(waiters) = lock(&self.waiters).as_mut() {
            waiters.remove(&id);
        }
    }

    async fn send(&self, mut message: Map<String, Value>) -> Result<(), RpcError> {
        if self.version_field {
            message.insert("jsonrpc".into(), json!("2.0"));
        }
        let mut line = serde_json::to_vec(&message).expect("a JSON map serializes");
        line.push(b'\n');
        self.out.send(line).await.map_err(|_| RpcError::Closed)
    }
}

/// A request sent with [`Peer::send_request`]; `wait` gives its result.
pub struct Pending {
    id: i64,
    method: String,
    rx: oneshot::Receiver<Result<Value, RpcError>>,
}

impl Pending {
    pub fn method(&self) -> &str {
        &self.method
    }

    pub async fn wait(self) -> Result<Value, RpcError> {
        self.rx.await.unwrap_or(Err(RpcError::Closed))
    }
}

/// Writes whole lines, so that a caller dropped mid-send cannot leave half a message.
async fn write_lines<W: AsyncWrite + Unpin>(mut writer: W, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(line) = lines.recv().await {
        let written = async {
            writer.write_all(&line).await?;
            writer.flush().await
        };
        if let Err(e) = written.await {
            tracing::debug!(error = %e, "writing to the agent failed; the writer stops");
            break;
        }
    }
}

async fn read_lines<R: AsyncRead + Unpin>(
    mut reader: LineReader<R>,
    incoming: mpsc::Sender<Incoming>,
    waiters: Waiters,
    closed: watch::Sender<Option<String>>,
) {
    let reason = loop {
        let line = match reader.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break String::new(),
            Err(FramingError::LineTooLong { len }) => {
                let error = format!(
                    "a message of {len} bytes exceeds the limit of {} bytes and was skipped",
                    reader.max_line()
                );
                if incoming.send(Incoming::Malformed { error }).await.is_err() {
                    break String::new();
                }
                continue;
            }
            Err(FramingError::Io(e)) => break e.to_string(),
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let message = match classify(&line) {
            Ok(Message::Response { id, result }) => {
                let waiter = lock(&waiters).as_mut().and_then(|w| w.remove(&id));
                match waiter {
                    Some(waiter) => {
                        let _ = waiter.send(result);
                    }
                    None => tracing::debug!(id, "an answer to no waiting request was dropped"),
                }
                continue;
            }
            Ok(Message::Incoming(message)) => message,
            Err(error) => Incoming::Malformed { error },
        };
        if incoming.send(message).await.is_err() {
            // Nobody reads any more; answers to our requests still matter, so go on.
            continue;
        }
    };
    let waiting = lock(&waiters).take().unwrap_or_default();
    for (_, waiter) in waiting {
        let _ = waiter.send(Err(RpcError::Closed));
    }
    let _ = closed.send(Some(reason));
}

enum Message {
    Response {
        id: i64,
        result: Result<Value, RpcError>,
    },
    Incoming(Incoming),
}

fn classify(line: &[u8]) -> Result<Message, String> {
    let value: Value = serde_json::from_slice(line).map_err(|e| {
        let shown = String::from_utf8_lossy(&line[..line.len().min(200)]).into_owned();
        format!("the agent wrote a line that is not JSON ({e}): {shown}")
    })?;
    let Value::Object(mut message) = value else {
        return Err("the agent wrote JSON that is not a message object".to_owned());
    };
    let params = message.remove("params").unwrap_or(Value::Null);
    match (
        message.get("method").and_then(Value::as_str),
        message.get("id"),
    ) {
        (Some(method), Some(id)) => {
            let id = RequestId::from_value(id)
                .ok_or_else(|| format!("a `{method}` request has an unusable id"))?;
            Ok(Message::Incoming(Incoming::Request {
                id,
                method: method.to_owned(),
                params,
            }))
        }
        (Some(method), None) => Ok(Message::Incoming(Incoming::Notification {
            method: method.to_owned(),
            params,
        })),
        (None, Some(id)) => {
            let Some(id) = id.as_i64() else {
                return Err(format!("an answer carries an id we never sent: {id}"));
            };
            let result = if let Some(error) = message.get("error") {
                Err(RpcError::Remote {
                    method: String::new(),
                    code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                    message: error
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown error")
                        .to_owned(),
                    data: error.get("data").cloned(),
                })
            } else {
                Ok(message.remove("result").unwrap_or(Value::Null))
            };
            Ok(Message::Response { id, result })
        }
        (None, None) => Err("the agent wrote a message with neither method nor id".to_owned()),
    }
}

impl RpcError {
    /// Name the method an error answered (responses do not carry it).
    fn for_method(self, method: &str) -> Self {
        match self {
            Self::Remote {
                code,
                message,
                data,
                ..
            } => Self::Remote {
                method: method.to_owned(),
                code,
                message,
                data,
            },
            other => other,
        }
    }
}

impl Pending {
    /// Like `wait`, with remote errors naming the method.
    pub async fn result(self) -> Result<Value, RpcError> {
        let method = self.method.clone();
        self.wait().await.map_err(|e| e.for_method(&method))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncBufReadExt, BufReader, DuplexStream};

    struct Other {
        lines: tokio::io::Lines<BufReader<tokio::io::ReadHalf<DuplexStream>>>,
        write: tokio::io::WriteHalf<DuplexStream>,
    }

    impl Other {
        async fn read(&mut self) -> Value {
            let line = self.lines.next_line().await.unwrap().expect("a line");
            serde_json::from_str(&line).unwrap()
        }
        async fn write(&mut self, text: &str) {
            self.write.write_all(text.as_bytes()).await.unwrap();
            self.write.write_all(b"\n").await.unwrap();
        }
    }

    fn pair(options: PeerOptions) -> (Peer, mpsc::Receiver<Incoming>, Other) {
        let (ours, theirs) = tokio::io::duplex(4096);
        let (read, write) = tokio::io::split(ours);
        let (peer, incoming) = Peer::start(read, write, options);
        let (r, w) = tokio::io::split(theirs);
        let other = Other {
            lines: BufReader::new(r).lines(),
            write: w,
        };
        (peer, incoming, other)
    }

    fn bare() -> PeerOptions {
        PeerOptions {
            version_field: false,
            ..PeerOptions::default()
        }
    }

    #[tokio::test]
    async fn requests_are_matched_to_answers_in_any_order() {
        let (peer, _incoming, mut other) = pair(bare());
        let a = peer.send_request("a", json!({"x": 1})).await.unwrap();
        let b = peer.send_request("b", json!(null)).await.unwrap();
        let first = other.read().await;
        let second = other.read().await;
        assert_eq!(first, json!({"method": "a", "id": 0, "params": {"x": 1}}));
        assert_eq!(second["id"], 1);
        assert!(first.get("jsonrpc").is_none(), "no version field when told");
        other.write(r#"{"id":1,"result":"for b"}"#).await;
        other
            .write(r#"{"id":0,"error":{"code":-32600,"message":"bad a"}}"#)
            .await;
        assert_eq!(b.result().await.unwrap(), json!("for b"));
        match a.result().await {
            Err(RpcError::Remote {
                method,
                code,
                message,
                ..
            }) => {
                assert_eq!(
                    (method.as_str(), code, message.as_str()),
                    ("a", -32600, "bad a")
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_version_field_is_sent_when_asked_and_accepted_either_way() {
        let (peer, mut incoming, mut other) = pair(PeerOptions::default());
        peer.notify("hello", None).await.unwrap();
        assert_eq!(
            other.read().await,
            json!({"jsonrpc": "2.0", "method": "hello"})
        );
        other
            .write(r#"{"jsonrpc":"2.0","method":"n1","params":{"k":1}}"#)
            .await;
        other.write(r#"{"method":"n2"}"#).await;
        match incoming.recv().await.unwrap() {
            Incoming::Notification { method, params } => {
                assert_eq!((method.as_str(), params), ("n1", json!({"k": 1})));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            incoming.recv().await.unwrap(),
            Incoming::Notification { method, params: Value::Null } if method == "n2"
        ));
    }

    #[tokio::test]
    async fn the_peers_requests_are_answered_by_their_own_ids() {
        let (peer, mut incoming, mut other) = pair(bare());
        other
            .write(r#"{"method":"ask","id":0,"params":{"q":"?"}}"#)
            .await;
        other.write(r#"{"method":"ask","id":"s-1"}"#).await;
        let Incoming::Request { id, method, params } = incoming.recv().await.unwrap() else {
            panic!("expected a request")
        };
        assert_eq!((method.as_str(), &params), ("ask", &json!({"q": "?"})));
        peer.respond(&id, json!({"decision": "accept"}))
            .await
            .unwrap();
        assert_eq!(
            other.read().await,
            json!({"id": 0, "result": {"decision": "accept"}})
        );
        let Incoming::Request { id, .. } = incoming.recv().await.unwrap() else {
            panic!("expected a request")
        };
        assert_eq!(id, RequestId::Text("s-1".into()));
        peer.respond_error(&id, -32601, "no").await.unwrap();
        assert_eq!(
            other.read().await,
            json!({"id": "s-1", "error": {"code": -32601, "message": "no"}})
        );
    }

    #[tokio::test]
    async fn bad_lines_are_reported_and_reading_goes_on() {
        let (_peer, mut incoming, mut other) = pair(PeerOptions {
            max_line: 64,
            ..bare()
        });
        other.write("not json").await;
        other
            .write(&format!(r#"{{"method":"{}"}}"#, "x".repeat(100)))
            .await;
        other.write("[1,2]").await;
        other.write("").await;
        other.write(r#"{"method":"fine"}"#).await;
        for expected in ["not JSON", "exceeds the limit", "not a message"] {
            match incoming.recv().await.unwrap() {
                Incoming::Malformed { error } => assert!(error.contains(expected), "{error}"),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(matches!(
            incoming.recv().await.unwrap(),
            Incoming::Notification { method, .. } if method == "fine"
        ));
    }

    #[tokio::test]
    async fn a_request_times_out_and_its_late_answer_is_dropped() {
        let (peer, _incoming, mut other) = pair(bare());
        let err = peer
            .request("slow", json!({}), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::Timeout { ref method, .. } if method == "slow"));
        let sent = other.read().await;
        other
            .write(&format!(r#"{{"id":{},"result":1}}"#, sent["id"]))
            .await;
        // The connection still works.
        let next = peer.send_request("next", json!({})).await.unwrap();
        let sent = other.read().await;
        other
            .write(&format!(r#"{{"id":{},"result":2}}"#, sent["id"]))
            .await;
        assert_eq!(next.result().await.unwrap(), json!(2));
    }

    #[tokio::test]
    async fn the_end_of_input_fails_waiting_requests_and_closes_the_channel() {
        let (peer, mut incoming, other) = pair(bare());
        let waiting = peer.send_request("never", json!({})).await.unwrap();
        drop(other);
        assert!(matches!(waiting.result().await, Err(RpcError::Closed)));
        assert!(incoming.recv().await.is_none());
        assert_eq!(peer.closed().await, None);
        assert!(peer.is_closed());
        assert!(matches!(
            peer.request("late", json!({}), Duration::from_secs(1))
                .await,
            Err(RpcError::Closed)
        ));
    }

    #[tokio::test]
    async fn a_full_channel_stops_reading() {
        let (ours, mut theirs) = tokio::io::duplex(256);
        let (read, write) = tokio::io::split(ours);
        let (_peer, mut incoming) = Peer::start(
            read,
            write,
            PeerOptions {
                capacity: 2,
                ..bare()
            },
        );
        // Far more than the pipe and the channel hold: the writer must block.
        let line = format!("{{\"method\":\"n\",\"params\":\"{}\"}}\n", "y".repeat(100));
        let writer = tokio::spawn(async move {
            for _ in 0..200 {
                theirs.write_all(line.as_bytes()).await.unwrap();
            }
            theirs
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!writer.is_finished(), "the peer's writes are held back");
        let mut seen = 0;
        while seen < 200 {
            incoming.recv().await.unwrap();
            seen += 1;
        }
        let _theirs = writer.await.unwrap();
    }
}
