//! Between an ACP agent's stdout and the protocol SDK.
//!
//! **The update lane.** Once the connection is initialized, a `session/update`
//! notification is not handed to the SDK at all: [`UpdateGate`] sends its line down a lane
//! ([`UpdateLane`]) that the session handler reads and handles itself, from the raw bytes
//! in one parse. Notifications need no answer, so the SDK has nothing to do with them, and
//! its general path (a JSON value, a generic message, the dispatch chain, then the params
//! again) costs several times the handling itself on a busy agent. Wire order is kept:
//! any other line (an answer to our request, the agent's own request, anything
//! unparsable) and the end of the output are handed to the SDK only once every update
//! read before them has been handled.
//!
//! **Back-pressure.** At most `limit` updates are read and not yet handled
//! ([`UpdateCredits::release`], called once the event is in the actor's bounded channel).
//! At the limit the gate stops reading: the pipe fills and the agent blocks on its next
//! write. The SDK alone would read every line it can into an unbounded queue.

use std::borrow::Cow;
use std::fmt;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::mpsc;

/// Bytes asked of the pipe per read.
const READ_CHUNK: usize = 16 * 1024;

/// Credits for `session/update` lines read from the agent and not yet handled.
pub(crate) struct UpdateCredits {
    limit: usize,
    in_flight: AtomicUsize,
    /// Counting (and the lane) start once the agent has answered `initialize`: before
    /// that the SDK refuses notifications, and so do we.
    armed: AtomicBool,
    /// The reader waiting for a credit, or for every update to be handled.
    waiter: Mutex<Option<Waker>>,
}

impl UpdateCredits {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            in_flight: AtomicUsize::new(0),
            armed: AtomicBool::new(false),
            waiter: Mutex::new(None),
        }
    }

    /// Start counting (the connection is initialized).
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// `session/update` lines handed to the SDK and not yet handled.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// One `session/update` has been handled. A release without a matching take (a line
    /// read before counting started) is ignored.
    pub(crate) fn release(&self) {
        let released = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if released && let Some(waker) = self.waiter().take() {
            waker.wake();
        }
    }

    /// Take a credit for one update: `true` once taken, `false` (at once) while nothing is
    /// counted yet.
    fn poll_take(&self, cx: &mut Context<'_>) -> Poll<bool> {
        if !self.armed.load(Ordering::Acquire) {
            return Poll::Ready(false);
        }
        loop {
            let n = self.in_flight.load(Ordering::Acquire);
            if n >= self.limit {
                *self.waiter() = Some(cx.waker().clone());
                // A release between the load and the registration would be missed.
                if self.in_flight.load(Ordering::Acquire) >= self.limit {
                    return Poll::Pending;
                }
                continue;
            }
            if self
                .in_flight
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Poll::Ready(true);
            }
        }
    }

    /// Ready once every update read so far has been handled.
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return Poll::Ready(());
        }
        *self.waiter() = Some(cx.waker().clone());
        // A release between the load and the registration would be missed.
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    fn waiter(&self) -> std::sync::MutexGuard<'_, Option<Waker>> {
        self.waiter
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Releases one credit when dropped, however the handling of the update ends.
pub(crate) struct UpdateHandled<'a>(pub(crate) &'a UpdateCredits);

impl Drop for UpdateHandled<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Where the gate sends the `session/update` lines it takes out of the SDK's stream, one
/// credit each; the reader releases the credit once the line is handled.
pub(crate) type UpdateLane = mpsc::UnboundedReceiver<Vec<u8>>;

/// The agent's stdout as the SDK reads it: updates taken out to the lane, a credit each;
/// every other line after the updates before it are handled.
pub(crate) struct UpdateGate<R> {
    inner: R,
    credits: std::sync::Arc<UpdateCredits>,
    /// Bounded by the credits, not by the channel.
    lane: mpsc::UnboundedSender<Vec<u8>>,
    /// Bytes read from the pipe and not yet handed over: `buf[start..]`.
    buf: Vec<u8>,
    start: usize,
    /// `buf[start..cleared]` may be handed over now.
    cleared: usize,
    /// `buf[cleared..scanned]` holds no newline.
    scanned: usize,
    /// The line ending at this offset is an update that waits for its credit.
    waiting_for_credit: Option<usize>,
    /// The line ending at this offset is for the SDK, once the updates before it are
    /// handled.
    waiting_for_drain: Option<usize>,
    eof: bool,
}

impl<R> UpdateGate<R> {
    pub(crate) fn new(inner: R, credits: std::sync::Arc<UpdateCredits>) -> (Self, UpdateLane) {
        let (lane, updates) = mpsc::unbounded_channel();
        let gate = Self {
            inner,
            credits,
            lane,
            buf: Vec::new(),
            start: 0,
            cleared: 0,
            scanned: 0,
            waiting_for_credit: None,
            waiting_for_drain: None,
            eof: false,
        };
        (gate, updates)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for UpdateGate<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.cleared > this.start {
                let n = (this.cleared - this.start).min(out.remaining());
                out.put_slice(&this.buf[this.start..this.start + n]);
                this.start += n;
                return Poll::Ready(Ok(()));
            }
            // Here everything cleared is handed over: `start == cleared`.
            if let Some(end) = this.waiting_for_credit {
                let counted = std::task::ready!(this.credits.poll_take(cx));
                this.waiting_for_credit = None;
                this.scanned = end;
                if counted {
                    // To the lane, not to the SDK. Were the lane's reader gone (the
                    // session is ending), the line is dropped with its credit.
                    let line = this.buf[this.cleared..end].to_vec();
                    if this.lane.send(line).is_err() {
                        this.credits.release();
                    }
                    this.start = end;
                }
                this.cleared = end;
                continue;
            }
            if let Some(end) = this.waiting_for_drain {
                std::task::ready!(this.credits.poll_drained(cx));
                this.waiting_for_drain = None;
                this.cleared = end;
                this.scanned = end;
                continue;
            }
            if let Some(i) = memchr(b'\n', &this.buf[this.scanned..]) {
                let end = this.scanned + i + 1;
                if is_session_update(&this.buf[this.cleared..end]) {
                    this.waiting_for_credit = Some(end);
                } else {
                    this.waiting_for_drain = Some(end);
                }
                continue;
            }
            this.scanned = this.buf.len();
            if this.eof {
                // A last line without a newline: the SDK reads it as a line too.
                if this.cleared < this.buf.len() {
                    this.waiting_for_drain = Some(this.buf.len());
                    continue;
                }
                // The end of the output, too, follows the updates before it.
                std::task::ready!(this.credits.poll_drained(cx));
                return Poll::Ready(Ok(()));
            }
            // Everything before `start` is handed over: drop it before reading more.
            if this.start > 0 {
                this.buf.drain(..this.start);
                this.cleared -= this.start;
                this.scanned -= this.start;
                this.start = 0;
            }
            // Read into the spare capacity as it is: zeroing 16 KiB before every read
            // (most of which find one short line, or nothing) cost more than the read.
            let len = this.buf.len();
            this.buf.reserve(READ_CHUNK);
            let mut chunk = ReadBuf::uninit(this.buf.spare_capacity_mut());
            let polled = Pin::new(&mut this.inner).poll_read(cx, &mut chunk);
            let got = chunk.filled().len();
            // SAFETY: `ReadBuf` counts as filled only bytes the reader initialized, and
            // they start at the spare capacity's first byte, right after `len`.
            unsafe { this.buf.set_len(len + got) };
            match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => this.eof = got == 0,
            }
        }
    }
}

fn memchr(needle: u8, haystack: &[u8]) -> Option<usize> {
    haystack.iter().position(|&b| b == needle)
}

/// Whether the SDK will hand this line to our handler as a `session/update`
/// notification: a JSON-RPC 2.0 object with that method, no `id`, `result` or `error`,
/// and params that are absent, null, an object or an array. Anything else is not counted
/// (a line counted but never handled would hold its credit for good).
fn is_session_update(line: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Envelope<'a> {
        #[serde(borrow, default)]
        jsonrpc: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        method: Option<Cow<'a, str>>,
        #[serde(default, deserialize_with = "present")]
        id: bool,
        #[serde(default, deserialize_with = "present")]
        result: bool,
        #[serde(default, deserialize_with = "present")]
        error: bool,
        #[serde(default = "yes", deserialize_with = "params_shape")]
        params: bool,
    }
    match serde_json::from_slice::<Envelope<'_>>(line) {
        Ok(e) => {
            e.jsonrpc.as_deref() == Some("2.0")
                && e.method.as_deref() == Some("session/update")
                && !(e.id || e.result || e.error)
                && e.params
        }
        Err(_) => false,
    }
}

fn yes() -> bool {
    true
}

fn present<'de, D: de::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    IgnoredAny::deserialize(d).map(|_| true)
}

/// True for params the SDK accepts on a notification: null, an object or an array.
fn params_shape<'de, D: de::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    struct Shape;
    impl<'de> Visitor<'de> for Shape {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
            Ok(true)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(true)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(true)
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<bool, E> {
            Ok(false)
        }
    }
    d.deserialize_any(Shape)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const UPDATE: &str =
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{}}}"#;

    #[test]
    fn only_well_formed_session_update_notifications_are_counted() {
        assert!(is_session_update(UPDATE.as_bytes()));
        assert!(is_session_update(
            b" {\"params\":null,\"method\":\"session/update\",\"jsonrpc\":\"2.0\"}\r\n"
        ));
        assert!(is_session_update(
            br#"{"jsonrpc":"2.0","method":"session\/update"}"#
        ));
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"session/update","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"session/update","params":{}}"#,
            r#"{"jsonrpc":"2.0","method":"session/update","params":1}"#,
            r#"{"jsonrpc":"2.0","method":"session/update","result":{}}"#,
            r#"{"method":"session/update","params":{}}"#,
            r#"{"jsonrpc":"2.0","method":"session/request_permission","id":3,"params":{}}"#,
            r#"{"jsonrpc":"2.0","id":4,"result":{"stopReason":"end_turn"}}"#,
            r#"["session/update"]"#,
            "session/update",
            "",
        ] {
            assert!(!is_session_update(line.as_bytes()), "{line}");
        }
    }

    /// What the SDK side can read within a moment.
    async fn read_for_a_moment(gate: &mut UpdateGate<tokio::io::DuplexStream>) -> String {
        let mut read = Vec::new();
        let mut chunk = [0u8; 64 * 1024];
        loop {
            let n =
                tokio::time::timeout(std::time::Duration::from_millis(200), gate.read(&mut chunk))
                    .await;
            match n {
                Ok(Ok(0)) | Err(_) => break,
                Ok(n) => read.extend_from_slice(&chunk[..n.unwrap()]),
            }
        }
        String::from_utf8(read).unwrap()
    }

    fn lane_lines(lane: &mut UpdateLane) -> Vec<String> {
        let mut lines = Vec::new();
        while let Ok(line) = lane.try_recv() {
            lines.push(String::from_utf8(line).unwrap());
        }
        lines
    }

    /// A gate with `limit` credits on one end of a pipe; the agent's end is returned.
    fn open_gate(
        limit: usize,
        armed: bool,
    ) -> (
        Arc<UpdateCredits>,
        tokio::io::DuplexStream,
        UpdateGate<tokio::io::DuplexStream>,
        UpdateLane,
    ) {
        let credits = Arc::new(UpdateCredits::new(limit));
        if armed {
            credits.arm();
        }
        let (agent, pipe) = tokio::io::duplex(1 << 20);
        let (gate, lane) = UpdateGate::new(pipe, credits.clone());
        (credits, agent, gate, lane)
    }

    #[tokio::test]
    async fn lines_longer_than_a_read_and_split_across_writes_come_out_whole() {
        let (_credits, mut agent, mut gate, _lane) = open_gate(8, false);
        let big = format!(
            r#"{{"jsonrpc":"2.0","id":1,"result":{{"text":"{}"}}}}"#,
            "x".repeat(3 * READ_CHUNK + 5)
        );
        let wire = format!("{UPDATE}\n{big}\n{UPDATE}\n{big}");
        let sent = wire.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.as_bytes().chunks(7_001) {
                agent.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut out = Vec::new();
        gate.read_to_end(&mut out).await.unwrap();
        writer.await.unwrap();
        assert_eq!(out.len(), wire.len());
        assert!(out == wire.as_bytes(), "every byte, in order");
    }

    #[tokio::test]
    async fn updates_go_down_the_lane_and_other_lines_wait_for_them() {
        let (credits, mut agent, mut gate, mut lane) = open_gate(8, true);
        let response = r#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
        let wire = format!("{UPDATE}\n{response}\n{UPDATE}\n{UPDATE}\n{response}\n");
        agent.write_all(wire.as_bytes()).await.unwrap();
        drop(agent);

        // The first update is out; the answer after it waits until it is handled.
        assert_eq!(read_for_a_moment(&mut gate).await, "");
        assert_eq!(lane_lines(&mut lane), [format!("{UPDATE}\n")]);
        credits.release();
        assert_eq!(read_for_a_moment(&mut gate).await, format!("{response}\n"));
        assert_eq!(lane_lines(&mut lane).len(), 2);
        assert_eq!(credits.in_flight(), 2);

        // The second answer, then the end of the output, only once both are handled.
        credits.release();
        assert_eq!(read_for_a_moment(&mut gate).await, "");
        credits.release();
        let mut rest = Vec::new();
        gate.read_to_end(&mut rest).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&rest), format!("{response}\n"));
        assert_eq!(credits.in_flight(), 0);
    }

    #[tokio::test]
    async fn reading_stops_at_the_limit_and_resumes_on_release() {
        let (credits, mut agent, mut gate, mut lane) = open_gate(2, true);
        let wire = format!("{UPDATE}\n{UPDATE}\n{UPDATE}\n");
        agent.write_all(wire.as_bytes()).await.unwrap();

        assert_eq!(read_for_a_moment(&mut gate).await, "");
        assert_eq!(lane_lines(&mut lane).len(), 2, "two credits, two updates");
        assert_eq!(credits.in_flight(), 2);
        credits.release();
        assert_eq!(read_for_a_moment(&mut gate).await, "");
        assert_eq!(
            lane_lines(&mut lane).len(),
            1,
            "the third took the credit given back"
        );
        assert_eq!(credits.in_flight(), 2);
    }

    #[tokio::test]
    async fn an_update_is_dropped_with_its_credit_once_the_lane_is_gone() {
        let (credits, mut agent, mut gate, lane) = open_gate(1, true);
        drop(lane);
        agent
            .write_all(format!("{UPDATE}\n{UPDATE}\n").as_bytes())
            .await
            .unwrap();
        drop(agent);
        let mut rest = Vec::new();
        gate.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        assert_eq!(credits.in_flight(), 0);
    }

    #[tokio::test]
    async fn nothing_is_counted_before_arming_and_a_stray_release_is_ignored() {
        let (credits, mut agent, mut gate, mut lane) = open_gate(1, false);
        credits.release();
        let wire = format!("{UPDATE}\n{UPDATE}\n{UPDATE}");
        agent.write_all(wire.as_bytes()).await.unwrap();
        drop(agent);
        let mut read = String::new();
        gate.read_to_string(&mut read).await.unwrap();
        assert_eq!(read, wire);
        assert!(lane_lines(&mut lane).is_empty());
        assert_eq!(credits.in_flight(), 0);
    }
}
