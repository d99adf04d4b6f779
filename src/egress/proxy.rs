//! One endpoint's connections: read a bounded request head, then tunnel (`CONNECT`),
//! forward (absolute-form HTTP) or broker (origin-form under a brokered provider's
//! path), each after the allow-list and address checks, to the address that was checked.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use super::{AgentState, DenialReason, Verdict};
use crate::domain::net::is_internal;

/// Most header lines a request head may have.
const MAX_HEADERS: usize = 100;
/// How long, and how many bytes, a refused client's further sending is read and dropped.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 256 * 1024;
/// Bytes copied at a time in each direction.
const CHUNK: usize = 16 * 1024;

/// Headers that describe one hop, never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
    "host",
];

/// Credential headers an agent may send to a brokered path: dropped, so that only the
/// ones the proxy adds reach the upstream.
const CREDENTIAL_HEADERS: &[&str] = &["authorization", "x-api-key", "x-goog-api-key", "api-key"];

pub(crate) async fn accept(
    listener: UnixListener,
    state: Arc<AgentState>,
    stop: CancellationToken,
) {
    let slots = super::slots(&state.limits);
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(holder = %state.holder, error = %e, "egress accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (state, stop, slots) = (state.clone(), stop.clone(), slots.clone());
        tokio::spawn(async move {
            let wait = state.limits.header_timeout;
            let permit = match tokio::time::timeout(wait, slots.acquire_owned()).await {
                Ok(Ok(p)) => p,
                _ => {
                    let mut stream = stream;
                    let _ =
                        respond(&mut stream, 503, "too many open connections for this agent").await;
                    return;
                }
            };
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = serve(stream, &state) => {}
            }
            drop(permit);
        });
    }
}

/// A request head as read from the client.
struct Head {
    method: String,
    target: String,
    headers: Vec<(String, Vec<u8>)>,
}

enum HeadError {
    /// The client went away or sent nothing in time.
    Gone,
    TooLarge,
    Malformed,
}

/// Read up to the end of the head (`\r\n\r\n`); what came after it is returned too.
async fn read_head(
    stream: &mut UnixStream,
    max: usize,
    wait: Duration,
) -> Result<(Head, Vec<u8>), HeadError> {
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let deadline = tokio::time::Instant::now() + wait;
    let end = loop {
        let mut chunk = [0u8; 4096];
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(HeadError::Gone),
            Ok(Ok(n)) => n,
        };
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            break from + i + 4;
        }
        if buf.len() > max {
            return Err(HeadError::TooLarge);
        }
    };
    if end > max {
        return Err(HeadError::TooLarge);
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&buf[..end]) {
        Ok(httparse::Status::Complete(_)) => {}
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        _ => return Err(HeadError::Malformed),
    }
    let head = Head {
        method: req.method.unwrap_or_default().to_owned(),
        target: req.path.unwrap_or_default().to_owned(),
        headers: req
            .headers
            .iter()
            .map(|h| (h.name.to_owned(), h.value.to_vec()))
            .collect(),
    };
    Ok((head, buf[end..].to_vec()))
}

async fn serve(mut client: UnixStream, state: &AgentState) {
    let limits = &state.limits;
    let (head, rest) =
        match read_head(&mut client, limits.max_header_bytes, limits.header_timeout).await {
            Ok(h) => h,
            Err(HeadError::Gone) => return,
            Err(HeadError::TooLarge) => {
                let _ = respond(&mut client, 431, "the request head is too large").await;
                return;
            }
            Err(HeadError::Malformed) => {
                let _ = respond(&mut client, 400, "not an HTTP request").await;
                return;
            }
        };
    if head.method.eq_ignore_ascii_case("CONNECT") {
        let Some((host, port)) = split_authority(&head.target) else {
            let _ = respond(&mut client, 400, "CONNECT needs host:port").await;
            return;
        };
        let Some(upstream) = reach(&mut client, state, &host, port).await else {
            return;
        };
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
        let mut upstream = upstream;
        if !rest.is_empty() && upstream.write_all(&rest).await.is_err() {
            return;
        }
        pipe(client, upstream, limits.idle_timeout, false).await;
    } else if head.target.starts_with('/') {
        broker(client, state, head, rest).await;
    } else {
        forward(client, state, head, rest).await;
    }
}

/// Absolute-form HTTP (`GET http://host/path`): checked, then sent on as origin-form with
/// one request per connection.
async fn forward(mut client: UnixStream, state: &AgentState, head: Head, rest: Vec<u8>) {
    let url = match url::Url::parse(&head.target) {
        Ok(u) if u.scheme() == "http" && u.host_str().is_some() => u,
        Ok(u) if u.scheme() == "https" => {
            let _ = respond(&mut client, 400, "use CONNECT for https").await;
            return;
        }
        _ => {
            let _ = respond(&mut client, 400, "expected an absolute http:// URL").await;
            return;
        }
    };
    let host = url.host_str().unwrap_or_default().to_owned();
    let port = url.port_or_known_default().unwrap_or(80);
    let Some(mut upstream) = reach(&mut client, state, &host, port).await else {
        return;
    };
    let mut path = url.path().to_owned();
    if let Some(q) = url.query() {
        path.push('?');
        path.push_str(q);
    }
    let authority = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.clone(),
    };
    let out = rewrite(&head, &path, &authority, &[], &[]);
    if upstream.write_all(&out).await.is_err() || upstream.write_all(&rest).await.is_err() {
        return;
    }
    pipe(client, upstream, state.limits.idle_timeout, true).await;
}

/// Origin-form under a brokered provider's path: sent to its upstream with its
/// credential headers.
async fn broker(mut client: UnixStream, state: &AgentState, head: Head, rest: Vec<u8>) {
    let Some((b, tail)) = state
        .brokered
        .iter()
        .find_map(|b| brokered_tail(&head.target, &b.path_prefix).map(|t| (b, t)))
    else {
        let _ = respond(
            &mut client,
            404,
            "no brokered provider at this path; this port is a proxy for other requests",
        )
        .await;
        return;
    };
    let base = &b.upstream_base;
    let Some(host) = base.host_str().map(str::to_owned) else {
        let _ = respond(&mut client, 502, "the provider's upstream names no host").await;
        return;
    };
    let port = base.port_or_known_default().unwrap_or(443);
    let path = format!("{}{}", base.path().trim_end_matches('/'), tail);
    let authority = match base.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.clone(),
    };
    let drop: Vec<&str> = CREDENTIAL_HEADERS
        .iter()
        .copied()
        .chain(b.headers.iter().map(|(n, _)| n.as_str()))
        .collect();
    let add: Vec<(&str, &[u8])> = b
        .headers
        .iter()
        // A value that would end its header line is never sent.
        .filter(|(_, v)| !v.expose().contains(['\r', '\n']))
        .map(|(n, v)| (n.as_str(), v.expose().as_bytes()))
        .collect();
    let out = rewrite(&head, &path, &authority, &drop, &add);
    let upstream = match connect(&host, port, state.limits.header_timeout).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(holder = %state.holder, provider = %b.provider, error = %e, "brokered upstream unreachable");
            let _ = respond(&mut client, 502, "the provider's upstream is unreachable").await;
            return;
        }
    };
    state.count(&host);
    let idle = state.limits.idle_timeout;
    if base.scheme() == "https" {
        let tls = match tls_connect(&host, upstream).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(holder = %state.holder, provider = %b.provider, error = %e, "brokered upstream TLS failed");
                let _ = respond(&mut client, 502, "TLS to the provider's upstream failed").await;
                return;
            }
        };
        send_then_pipe(client, tls, out, rest, idle).await;
    } else {
        send_then_pipe(client, upstream, out, rest, idle).await;
    }
}

async fn send_then_pipe<S>(
    client: UnixStream,
    mut upstream: S,
    head: Vec<u8>,
    rest: Vec<u8>,
    idle: Duration,
) where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if upstream.write_all(&head).await.is_err() || upstream.write_all(&rest).await.is_err() {
        return;
    }
    pipe(client, upstream, idle, true).await;
}

/// `target` is `/<prefix>` or under it; what follows the prefix (starting with `/` or
/// `?`, or empty).
fn brokered_tail<'a>(target: &'a str, prefix: &str) -> Option<&'a str> {
    let prefix = prefix.trim_matches('/');
    if prefix.is_empty() {
        return None;
    }
    let tail = target.strip_prefix('/')?.strip_prefix(prefix)?;
    (tail.is_empty() || tail.starts_with('/') || tail.starts_with('?')).then_some(tail)
}

/// The head sent upstream: origin-form `path`, the client's headers but hop-by-hop ones
/// and those named in `drop`, `Host: authority`, the `add` headers, one request per
/// connection.
fn rewrite(
    head: &Head,
    path: &str,
    authority: &str,
    drop: &[&str],
    add: &[(&str, &[u8])],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(1024);
    out.extend_from_slice(head.method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(if path.is_empty() { "/" } else { path }.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: ");
    out.extend_from_slice(authority.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &head.headers {
        let lower = name.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&lower.as_str()) || drop.iter().any(|d| d.eq_ignore_ascii_case(name))
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in add {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// `host:port` (an IPv6 host in brackets).
fn split_authority(target: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = target.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        (h, p)
    } else {
        target.rsplit_once(':')?
    };
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// Check `host:port` against the agent's list and the address rule, resolve it once and
/// connect to an address that was checked. A refusal is answered (and reported) here.
async fn reach(
    client: &mut UnixStream,
    state: &AgentState,
    host: &str,
    port: u16,
) -> Option<TcpStream> {
    let Some(name) = super::normalise_host(host) else {
        let _ = respond(client, 400, "not a host name").await;
        return None;
    };
    let explicit = match state.policy.check(&name, port) {
        Verdict::Refused => {
            refuse(client, state, &name, port, DenialReason::NotAllowed).await;
            return None;
        }
        Verdict::Allowed { explicit } => explicit,
    };
    let wait = state.limits.header_timeout;
    let addrs = match resolve(&name, port, wait).await {
        Ok(a) if !a.is_empty() => a,
        _ => {
            let _ = respond(client, 502, "the host name does not resolve").await;
            return None;
        }
    };
    if !explicit && addrs.iter().any(|a| is_internal(a.ip())) {
        refuse(client, state, &name, port, DenialReason::InternalAddress).await;
        return None;
    }
    // The server's own loopback only by an entry of the server's (never a team's).
    if addrs.iter().any(|a| super::is_loopback(a.ip())) && !state.policy.opens_loopback(&name, port)
    {
        refuse(client, state, &name, port, DenialReason::InternalAddress).await;
        return None;
    }
    match connect_any(&addrs, wait).await {
        Ok(s) => {
            state.count(&name);
            Some(s)
        }
        Err(_) => {
            let _ = respond(client, 502, "the host is unreachable").await;
            None
        }
    }
}

async fn refuse(
    client: &mut UnixStream,
    state: &AgentState,
    host: &str,
    port: u16,
    reason: DenialReason,
) {
    state.deny(host, port, reason);
    let body = format!(
        "agentry egress refused {host}:{port} ({}): {}",
        reason.as_str(),
        reason.explain()
    );
    let _ = respond(client, 403, &body).await;
}

async fn resolve(host: &str, port: u16, wait: Duration) -> std::io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    match tokio::time::timeout(wait, tokio::net::lookup_host((host, port))).await {
        Ok(r) => Ok(r?.collect()),
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

async fn connect_any(addrs: &[SocketAddr], wait: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::from(std::io::ErrorKind::NotFound);
    for a in addrs {
        match tokio::time::timeout(wait, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e,
            Err(_) => last = std::io::ErrorKind::TimedOut.into(),
        }
    }
    Err(last)
}

/// A brokered upstream is the server's own setting: resolved and reached as named.
async fn connect(host: &str, port: u16, wait: Duration) -> std::io::Result<TcpStream> {
    let addrs = resolve(host, port, wait).await?;
    connect_any(&addrs, wait).await
}

async fn tls_connect(
    host: &str,
    tcp: TcpStream,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    use rustls_platform_verifier::ConfigVerifierExt;
    let config = rustls::ClientConfig::with_platform_verifier().map_err(std::io::Error::other)?;
    let name =
        rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(std::io::Error::other)?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// A short plain-text answer, then the connection closes. What the client still sends
/// is read and dropped for a moment (at most `LINGER_BYTES`), so that closing with unread
/// bytes does not reset the connection before the client has read the answer.
async fn respond(w: &mut UnixStream, status: u16, body: &str) -> std::io::Result<()> {
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        _ => "Service Unavailable",
    };
    let msg = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}\n",
        body.len() + 1
    );
    w.write_all(msg.as_bytes()).await?;
    w.shutdown().await?;
    let drain = async {
        let mut left = LINGER_BYTES;
        let mut buf = [0u8; 4096];
        while left > 0 {
            match w.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
    Ok(())
}

/// Copy both ways until both ends are done (or, with `response_ends`, until the upstream
/// has answered and closed), closing after `idle` without a byte either way.
async fn pipe<A, B>(client: A, upstream: B, idle: Duration, response_ends: bool)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (cr, cw) = tokio::io::split(client);
    let (ur, uw) = tokio::io::split(upstream);
    let activity = Activity::new();
    let up = copy_half(cr, uw, &activity, idle);
    let down = copy_half(ur, cw, &activity, idle);
    if response_ends {
        tokio::pin!(up);
        tokio::pin!(down);
        tokio::select! {
            _ = &mut up => (&mut down).await,
            _ = &mut down => {}
        }
    } else {
        tokio::join!(up, down);
    }
}

/// When either direction last moved a byte.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

async fn copy_half<R, W>(mut r: R, mut w: W, activity: &Activity, idle: Duration)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; CHUNK];
    loop {
        match tokio::time::timeout(idle, r.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                activity.touch();
                if w.write_all(&buf[..n]).await.is_err() || w.flush().await.is_err() {
                    break;
                }
            }
            Err(_) if activity.idle_for() >= idle => break,
            Err(_) => {}
        }
    }
    let _ = w.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_split_into_host_and_port() {
        assert_eq!(
            split_authority("example.com:443"),
            Some(("example.com".into(), 443))
        );
        assert_eq!(split_authority("[::1]:8080"), Some(("::1".into(), 8080)));
        assert_eq!(split_authority("example.com"), None);
        assert_eq!(split_authority("example.com:0"), None);
        assert_eq!(split_authority(":443"), None);
        assert_eq!(split_authority("example.com:+1"), None);
    }

    #[test]
    fn brokered_paths_match_whole_segments() {
        assert_eq!(
            brokered_tail("/anthropic/v1/messages", "anthropic"),
            Some("/v1/messages")
        );
        assert_eq!(brokered_tail("/anthropic", "/anthropic/"), Some(""));
        assert_eq!(brokered_tail("/anthropic?x=1", "anthropic"), Some("?x=1"));
        assert_eq!(brokered_tail("/anthropicx/v1", "anthropic"), None);
        assert_eq!(brokered_tail("/v1/messages", "anthropic"), None);
        assert_eq!(brokered_tail("/anything", ""), None);
    }

    #[test]
    fn rewriting_drops_hop_and_credential_headers_and_adds_the_brokered_ones() {
        let head = Head {
            method: "POST".into(),
            target: "/anthropic/v1/messages".into(),
            headers: vec![
                ("Host".into(), b"127.0.0.1:3128".to_vec()),
                ("x-api-key".into(), b"placeholder".to_vec()),
                ("Proxy-Authorization".into(), b"Basic abc".to_vec()),
                ("Content-Length".into(), b"2".to_vec()),
                ("Connection".into(), b"keep-alive".to_vec()),
            ],
        };
        let out = rewrite(
            &head,
            "/v1/messages",
            "api.example.com",
            &["x-api-key"],
            &[("x-api-key", b"real")],
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/messages HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 2\r\n\
             x-api-key: real\r\nConnection: close\r\n\r\n"
        );
    }
}
