//! The proxy end to end on its Unix socket: real TCP servers on loopback stand in for the
//! world (loopback is internal, so the lists name it explicitly unless a test is about
//! that rule).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::Mutex;

use super::*;

fn agent() -> AgentId {
    AgentId::new()
}

fn list(entries: &[&str]) -> AllowList {
    AllowList::parse(entries).unwrap()
}

/// A TCP server that echoes; counts the connections it accepted.
async fn echo_server() -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (port, accepted)
}

/// An HTTP server that records each request (head and body up to the connection's end
/// of request) and answers with `chunks`, pausing `pause` between them.
async fn http_server(chunks: Vec<&'static str>, pause: Duration) -> (u16, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (record, chunks) = (record.clone(), chunks.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The head, then a body of Content-Length bytes.
                loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                record
                    .lock()
                    .await
                    .push(String::from_utf8_lossy(&buf).to_string());
                for (i, c) in chunks.iter().enumerate() {
                    if i > 0 {
                        tokio::time::sleep(pause).await;
                    }
                    if s.write_all(c.as_bytes()).await.is_err() {
                        return;
                    }
                }
                let _ = s.shutdown().await;
            });
        }
    });
    (port, seen)
}

async fn dial(egress: &Egress, agent: AgentId) -> UnixStream {
    let path = egress
        .root()
        .join(agent.uuid().to_string())
        .join(SOCKET_NAME);
    UnixStream::connect(path).await.unwrap()
}

/// Send `request`, read until the proxy closes.
async fn exchange(egress: &Egress, agent: AgentId, request: &str) -> String {
    let mut s = dial(egress, agent).await;
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the proxy answers")
        .unwrap();
    String::from_utf8_lossy(&out).to_string()
}

fn proxy() -> (tempfile::TempDir, Egress, mpsc::Receiver<Denial>) {
    let dir = tempfile::tempdir().unwrap();
    let (egress, denials) = Egress::start(dir.path().join("egress"));
    (dir, egress, denials)
}

#[tokio::test]
async fn connect_tunnels_to_an_allowed_host_and_counts_it() {
    let (_dir, egress, mut denials) = proxy();
    let (port, accepted) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&[&format!("127.0.0.1:{port}")]), vec![])
        .unwrap();
    let mut s = dial(&egress, a).await;
    s.write_all(
        format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 39];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200 Connection established\r\n\r\n");
    s.write_all(b"ping through the tunnel").await.unwrap();
    let mut back = [0u8; 23];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping through the tunnel");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    assert_eq!(
        egress.counts(a).unwrap(),
        BTreeMap::from([("127.0.0.1".to_owned(), 1)])
    );
    assert!(denials.try_recv().is_err(), "nothing was refused");
}

#[tokio::test]
async fn plain_http_is_forwarded_as_origin_form_without_proxy_headers() {
    let (_dir, egress, _denials) = proxy();
    let (port, seen) = http_server(
        vec!["HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
        Duration::ZERO,
    )
    .await;
    let a = agent();
    egress
        .open(a, list(&[&format!("127.0.0.1:{port}")]), vec![])
        .unwrap();
    let answer = exchange(
        &egress,
        a,
        &format!(
            "GET http://127.0.0.1:{port}/path?q=1 HTTP/1.1\r\nHost: elsewhere.example\r\n\
             Proxy-Authorization: Basic c2VjcmV0\r\nAccept: */*\r\n\r\n"
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.ends_with("hello"), "{answer}");
    let seen = seen.lock().await;
    let req = &seen[0];
    assert!(req.starts_with("GET /path?q=1 HTTP/1.1\r\n"), "{req}");
    assert!(
        req.contains(&format!("Host: 127.0.0.1:{port}\r\n")),
        "{req}"
    );
    assert!(req.contains("Accept: */*\r\n"), "{req}");
    assert!(!req.contains("Proxy-Authorization"), "{req}");
    assert!(!req.contains("elsewhere.example"), "{req}");
}

#[tokio::test]
async fn a_host_off_the_list_is_refused_reported_and_never_reached() {
    let (_dir, egress, mut denials) = proxy();
    let (port, accepted) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&["api.anthropic.com"]), vec![])
        .unwrap();
    let answer = exchange(
        &egress,
        a,
        &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
    assert!(answer.contains(&format!("127.0.0.1:{port}")), "{answer}");
    assert!(answer.contains("not_allowed"), "{answer}");
    let answer = exchange(
        &egress,
        a,
        &format!("GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
    // An allowed name on another port is another host:port.
    let answer = exchange(
        &egress,
        a,
        "CONNECT api.anthropic.com:8443 HTTP/1.1\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
    for port in [port, port, 8443] {
        let d = denials.try_recv().expect("a denial");
        assert_eq!(d.holder, Holder::Agent(a));
        assert_eq!(d.port, port);
        assert_eq!(d.reason, DenialReason::NotAllowed);
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the host was never reached"
    );
    assert!(egress.counts(a).unwrap().is_empty());
}

#[tokio::test]
async fn internal_addresses_behind_a_wildcard_are_refused() {
    let (_dir, egress, mut denials) = proxy();
    let (port, accepted) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&[&format!("*:{port}")]), vec![])
        .unwrap();
    for host in ["localhost", "127.0.0.1"] {
        let answer = exchange(
            &egress,
            a,
            &format!("CONNECT {host}:{port} HTTP/1.1\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
        assert!(answer.contains("internal_address"), "{answer}");
        let d = denials.try_recv().expect("a denial");
        assert_eq!(
            (d.host.as_str(), d.reason),
            (host, DenialReason::InternalAddress)
        );
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 0);
    // Named exactly, the same host is reached.
    egress
        .open(a, list(&[&format!("localhost:{port}")]), vec![])
        .unwrap();
    let mut s = dial(&egress, a).await;
    s.write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 12];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200");
}

#[tokio::test]
async fn oversized_and_malformed_heads_are_refused() {
    let (_dir, egress, _denials) = proxy();
    let a = agent();
    egress.open(a, list(&["*"]), vec![]).unwrap();
    let big = format!(
        "GET http://example.com/ HTTP/1.1\r\nX: {}\r\n\r\n",
        "a".repeat(40_000)
    );
    let answer = exchange(&egress, a, &big).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    let answer = exchange(&egress, a, "\u{1}\u{2} nonsense\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let answer = exchange(&egress, a, "GET https://example.com/ HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
}

#[tokio::test]
async fn brokered_requests_carry_the_credential_and_stream_back() {
    let (_dir, egress, _denials) = proxy();
    let (port, seen) = http_server(
        vec![
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: one\n\n",
            "data: two\n\n",
        ],
        Duration::from_millis(1500),
    )
    .await;
    let a = agent();
    let brokered = Brokered {
        provider: "claude".into(),
        path_prefix: "anthropic".into(),
        upstream_base: Url::parse(&format!("http://127.0.0.1:{port}/base")).unwrap(),
        headers: vec![("x-api-key".into(), SecretValue::new("sk-team-key"))],
    };
    // The upstream is the server's own setting: no allow-list entry is needed for it.
    egress
        .open(a, AllowList::default(), vec![brokered])
        .unwrap();
    let mut s = dial(&egress, a).await;
    s.write_all(
        b"POST /anthropic/v1/messages?beta=true HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n\
          x-api-key: placeholder\r\nAuthorization: Bearer inside\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    // The first event arrives while the upstream still holds the second.
    let mut first = Vec::new();
    let started = std::time::Instant::now();
    while !String::from_utf8_lossy(&first).contains("data: one") {
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed early");
        first.extend_from_slice(&buf[..n]);
    }
    assert!(started.elapsed() < Duration::from_millis(1200));
    assert!(!String::from_utf8_lossy(&first).contains("data: two"));
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).await.unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("data: two"));
    let seen = seen.lock().await;
    let req = &seen[0];
    assert!(
        req.starts_with("POST /base/v1/messages?beta=true HTTP/1.1\r\n"),
        "{req}"
    );
    assert!(req.contains("x-api-key: sk-team-key\r\n"), "{req}");
    assert!(!req.contains("placeholder"), "{req}");
    assert!(!req.contains("Bearer inside"), "{req}");
    assert!(
        req.contains(&format!("Host: 127.0.0.1:{port}\r\n")),
        "{req}"
    );
    assert!(req.ends_with("\r\n\r\n{}"), "{req}");
    assert_eq!(egress.counts(a).unwrap()["127.0.0.1"], 1);
    drop(seen);
    // Another path is no brokered provider.
    let answer = exchange(&egress, a, "GET /openai/v1/models HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}

#[tokio::test]
async fn the_plan_mounts_the_endpoint_and_runs_the_bridge_first() {
    let (_dir, egress, _denials) = proxy();
    let egress = egress.with_bridge_program("/opt/agentry".into());
    let a = agent();
    let net = egress.open(a, AllowList::default(), vec![]).unwrap();
    let dir = egress.root().join(a.uuid().to_string());
    assert!(net.unshare_net);
    assert_eq!(
        net.binds,
        vec![(dir.clone(), PathBuf::from("/run/agentry"))]
    );
    assert_eq!(net.env["HTTPS_PROXY"], "http://127.0.0.1:3128");
    assert_eq!(net.env["http_proxy"], "http://127.0.0.1:3128");
    assert!(net.env["NO_PROXY"].contains("127.0.0.1"));
    assert_eq!(
        net.argv_prefix,
        [
            "/opt/agentry",
            "sandbox-bridge",
            "--listen",
            "127.0.0.1:3128",
            "--socket",
            "/run/agentry/egress.sock",
            "--"
        ]
    );
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(egress.root()), 0o700);
    assert_eq!(mode(&dir), 0o700);
    assert!(dir.join(SOCKET_NAME).exists());
    egress.close(a);
    assert!(!dir.exists(), "closing removes the endpoint");
    assert!(egress.counts(a).is_none());
    assert_eq!(
        brokered_base_url("/anthropic/"),
        "http://127.0.0.1:3128/anthropic"
    );
}

#[test]
fn the_small_bridge_executable_beside_agentry_is_preferred() {
    let dir = tempfile::tempdir().unwrap();
    let agentry = dir.path().join("agentry");
    std::fs::write(&agentry, b"").unwrap();
    assert_eq!(
        bridge_command(&agentry),
        [agentry.display().to_string(), "sandbox-bridge".to_owned()]
    );
    let small = dir.path().join("agentry-sandbox");
    std::fs::write(&small, b"").unwrap();
    assert_eq!(
        bridge_command(&agentry),
        [small.display().to_string(), "bridge".to_owned()]
    );
}

#[test]
fn the_bridges_command_line_is_read_back_as_written() {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let parsed = bridge::BridgeArgs::parse(&args(&[
        "--listen",
        "127.0.0.1:3128",
        "--socket",
        "/run/agentry/egress.sock",
        "--loopback",
        "127.0.0.1:9000",
        "--loopback",
        "localhost:9001",
        "--inbound",
        "/run/agentry/inbound-4096.sock",
        "--inbound-port",
        "4096",
        "--",
        "opencode",
        "--port",
        "4096",
    ]))
    .unwrap();
    assert_eq!(parsed.listen, "127.0.0.1:3128".parse().unwrap());
    assert_eq!(parsed.socket, PathBuf::from("/run/agentry/egress.sock"));
    assert_eq!(parsed.loopback, ["127.0.0.1:9000", "localhost:9001"]);
    assert_eq!(
        parsed.inbound,
        Some((PathBuf::from("/run/agentry/inbound-4096.sock"), 4096))
    );
    // What follows `--` is the CLI's, flags included.
    assert_eq!(parsed.argv, ["opencode", "--port", "4096"]);
    for (bad, why) in [
        (
            &["--socket", "/s", "--", "cli"][..],
            "`--listen` is required",
        ),
        (
            &["--listen", "127.0.0.1:1", "--socket", "/s", "--"][..],
            "no command",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:1",
                "--socket",
                "/s",
                "--inbound",
                "/i",
                "--",
                "cli",
            ][..],
            "go together",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:1",
                "--socket",
                "/s",
                "--shell",
                "x",
                "--",
                "cli",
            ][..],
            "unknown argument",
        ),
        (&["--listen"][..], "needs a value"),
    ] {
        let e = bridge::BridgeArgs::parse(&args(bad))
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
}

#[tokio::test]
async fn the_bridge_is_told_the_loopback_forwards_of_the_servers_entries() {
    let (_dir, egress, _denials) = proxy();
    let egress = egress.with_bridge_program("/opt/agentry".into());
    let a = agent();
    let mut policy = list(&["127.0.0.1:7000"]);
    policy.forward_loopback([
        AllowEntry::parse("127.0.0.1:9000").unwrap(),
        AllowEntry::parse("localhost:9001").unwrap(),
    ]);
    let net = egress.open(a, policy, vec![]).unwrap();
    assert_eq!(
        net.argv_prefix[6..],
        [
            "--loopback",
            "127.0.0.1:9000",
            "--loopback",
            "localhost:9001",
            "--"
        ]
    );
    // What a forward sends is an ordinary CONNECT, checked like any other.
    let (port, _) = echo_server().await;
    let mut policy = AllowList::default();
    policy.forward_loopback([AllowEntry::parse(&format!("127.0.0.1:{port}")).unwrap()]);
    egress.open(a, policy, vec![]).unwrap();
    let mut s = dial(&egress, a).await;
    s.write_all(format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 39];
    s.read_exact(&mut buf).await.unwrap();
    assert!(buf.starts_with(b"HTTP/1.1 200"), "{buf:?}");
    drop(s);
    let answer = exchange(
        &egress,
        a,
        &format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", port ^ 1),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
}

#[tokio::test]
async fn closing_ends_open_tunnels() {
    let (_dir, egress, _denials) = proxy();
    let (port, _) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&[&format!("127.0.0.1:{port}")]), vec![])
        .unwrap();
    let mut s = dial(&egress, a).await;
    s.write_all(format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 39];
    s.read_exact(&mut buf).await.unwrap();
    egress.close(a);
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .expect("the tunnel ends")
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn connections_beyond_the_bound_are_answered_503() {
    let dir = tempfile::tempdir().unwrap();
    let (egress, _denials) = Egress::start_with(
        dir.path().join("egress"),
        EgressLimits {
            max_connections_per_agent: 1,
            header_timeout: Duration::from_millis(300),
            ..EgressLimits::default()
        },
    );
    let (port, _) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&[&format!("127.0.0.1:{port}")]), vec![])
        .unwrap();
    // An open tunnel holds the only slot.
    let mut held = dial(&egress, a).await;
    held.write_all(format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 39];
    held.read_exact(&mut buf).await.unwrap();
    let answer = exchange(
        &egress,
        a,
        &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    drop(held);
}

#[tokio::test]
async fn an_agent_retrying_a_refused_host_reports_a_bounded_number() {
    let (_dir, egress, mut denials) = proxy();
    let a = agent();
    egress.open(a, AllowList::default(), vec![]).unwrap();
    let tries = DENIALS_PER_MINUTE as usize + 10;
    for _ in 0..tries {
        let answer = exchange(
            &egress,
            a,
            "CONNECT blocked.example.com:443 HTTP/1.1\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    }
    let mut reported = 0;
    while denials.try_recv().is_ok() {
        reported += 1;
    }
    assert_eq!(reported, DENIALS_PER_MINUTE as usize);
    assert_eq!(egress.dropped_denials(), 10);
}

#[tokio::test]
async fn a_data_dir_too_long_for_socket_paths_gets_endpoints_in_a_short_private_directory() {
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("d".repeat(80)).join("egress");
    let (egress, _denials) = Egress::start(long.clone());
    assert_ne!(egress.root(), long.as_path());
    let root = egress.root().to_path_buf();
    assert!(longest_socket_path(&root) <= MAX_SOCKET_PATH, "{root:?}");
    let (port, _) = echo_server().await;
    let a = agent();
    egress
        .open(a, list(&[&format!("127.0.0.1:{port}")]), vec![])
        .unwrap();
    let mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{root:?}");
    // The endpoint answers like any other.
    let mut s = dial(&egress, a).await;
    s.write_all(format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 39];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200 Connection established\r\n\r\n");
    drop(s);
    // The stand-in directory goes with the proxy.
    egress.close_all();
    drop(egress);
    assert!(!root.exists(), "{root:?}");
}

#[test]
fn a_short_data_dir_keeps_its_endpoints() {
    let dir = tempfile::tempdir().unwrap();
    let (egress, _denials) = Egress::start(dir.path().join("egress"));
    assert_eq!(egress.root(), dir.path().join("egress"));
}

#[tokio::test]
async fn a_commands_endpoint_hears_its_own_refusals_and_goes_when_dropped() {
    let (_dir, egress, mut denials) = proxy();
    let (port, accepted) = echo_server().await;
    let mut run = egress
        .open_for_commands(list(&[&format!("127.0.0.1:{port}")]))
        .unwrap();
    assert!(run.net.unshare_net);
    let (dir, _) = run.net.binds[0].clone();
    assert_eq!(run.net.argv_prefix.last().map(String::as_str), Some("--"));
    let mut s = UnixStream::connect(dir.join(SOCKET_NAME)).await.unwrap();
    s.write_all(b"CONNECT blocked.example.com:443 HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 403 Forbidden"));
    let d = run.denials.try_recv().expect("the run's own denial");
    assert!(matches!(d.holder, Holder::Commands(_)), "{d:?}");
    assert_eq!((d.host.as_str(), d.port), ("blocked.example.com", 443));
    assert!(denials.try_recv().is_err(), "not an agent's denial");
    assert_eq!(accepted.load(Ordering::SeqCst), 0);

    let holder = run.holder;
    assert_eq!(egress.counts(holder), Some(Default::default()));
    drop(run);
    assert!(!dir.exists(), "dropping the run's endpoint removes it");
    assert!(egress.counts(holder).is_none());
}
