//! The bridge (`agentry sandbox-bridge`): the first process inside an agent's sandbox,
//! whose network namespace has nothing but loopback. It listens on a loopback port and
//! forwards every connection byte for byte to the agent's egress endpoint (a Unix socket
//! mounted into the sandbox), starts the CLI's argv with its stdio inherited, passes
//! `TERM` and `INT` on to it, and ends as the CLI ended: with its exit code, or killed by
//! the same signal. When the CLI serves the server on a loopback port (OpenCode's HTTP
//! server), the bridge also listens on a Unix socket in the endpoint's directory, which
//! the server reaches from outside, and forwards each connection to that port.
//!
//! Loopback forwards (`--loopback host:port`, the server's own `/mcp` and the loopback
//! entries of the server's allow lists): the bridge also listens on that port of the
//! sandbox's loopback and sends each connection through the egress endpoint as a
//! `CONNECT host:port` tunnel, so that the proxy checks it against the agent's allow list
//! (and records a refusal) like any other; a refused connection is closed.

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Semaphore;

/// Connections forwarded at once; more wait.
const MAX_CONNECTIONS: usize = 256;

/// What the bridge is told on its command line.
#[derive(Debug, Clone)]
pub struct BridgeArgs {
    pub listen: SocketAddr,
    pub socket: PathBuf,
    /// A Unix socket to listen on, and the loopback port its connections go to.
    pub inbound: Option<(PathBuf, u16)>,
    /// Loopback forwards: `host:port` on the host, reached from the same port inside.
    pub loopback: Vec<String>,
    pub argv: Vec<String>,
}

impl BridgeArgs {
    /// The bridge's command line after its command name: `--listen ADDR --socket PATH
    /// [--inbound PATH --inbound-port PORT] [--loopback HOST:PORT]... -- ARGV...`. The
    /// server writes it; both ways of starting the bridge (`agentry sandbox-bridge` and
    /// the small `agentry-sandbox bridge`) read it here.
    pub fn parse(args: &[String]) -> anyhow::Result<Self> {
        let (mut listen, mut socket, mut inbound, mut inbound_port) = (None, None, None, None);
        let mut loopback = Vec::new();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            if flag == "--" {
                break;
            }
            let mut value = || {
                it.next()
                    .ok_or_else(|| anyhow::anyhow!("sandbox-bridge: `{flag}` needs a value"))
            };
            match flag.as_str() {
                "--listen" => listen = Some(value()?.parse::<SocketAddr>()?),
                "--socket" => socket = Some(PathBuf::from(value()?)),
                "--inbound" => inbound = Some(PathBuf::from(value()?)),
                "--inbound-port" => inbound_port = Some(value()?.parse::<u16>()?),
                "--loopback" => loopback.push(value()?.clone()),
                other => anyhow::bail!("sandbox-bridge: unknown argument `{other}`"),
            }
        }
        let argv: Vec<String> = it.cloned().collect();
        if argv.is_empty() {
            anyhow::bail!("sandbox-bridge: no command to run after `--`");
        }
        let inbound = match (inbound, inbound_port) {
            (Some(path), Some(port)) => Some((path, port)),
            (None, None) => None,
            _ => anyhow::bail!("sandbox-bridge: `--inbound` and `--inbound-port` go together"),
        };
        Ok(Self {
            listen: listen
                .ok_or_else(|| anyhow::anyhow!("sandbox-bridge: `--listen` is required"))?,
            socket: socket
                .ok_or_else(|| anyhow::anyhow!("sandbox-bridge: `--socket` is required"))?,
            inbound,
            loopback,
            argv,
        })
    }
}

/// The most a proxy's answer to a forward's `CONNECT` may be.
const MAX_ANSWER: usize = 8 * 1024;

/// Where the bridge listens for the loopback forward to `target` (`host:port`): the
/// target's own loopback address, and for `127.0.0.1` and `localhost` both `127.0.0.1`
/// and `::1` (a client may resolve `localhost` either way).
pub fn loopback_listen(target: &str) -> Option<Vec<SocketAddr>> {
    let (host, port) = target.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    let v4 = SocketAddr::from(([127, 0, 0, 1], port));
    let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    if host == "localhost" {
        return Some(vec![v4, v6]);
    }
    let ip: std::net::IpAddr = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()?;
    if !ip.is_loopback() {
        return None;
    }
    Some(if ip == std::net::IpAddr::from([127, 0, 0, 1]) {
        vec![v4, v6]
    } else {
        vec![SocketAddr::new(ip, port)]
    })
}

/// The name of the inbound socket for loopback port `port` in an endpoint's directory.
pub fn inbound_socket_name(port: u16) -> String {
    format!("inbound-{port}.sock")
}

/// Run the bridge; returns only when it could not start (the process otherwise ends
/// the way the CLI ended).
pub fn run(args: BridgeArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let status = rt.block_on(bridge(args))?;
    drop(rt);
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    if let Some(sig) = status.signal() {
        // SAFETY: restoring the default action of a signal and raising it in this
        // process; no handler of ours runs afterwards.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
        std::process::exit(128 + sig);
    }
    std::process::exit(1)
}

async fn bridge(args: BridgeArgs) -> anyhow::Result<std::process::ExitStatus> {
    let Some((program, rest)) = args.argv.split_first() else {
        anyhow::bail!("sandbox-bridge: no command to run after `--`");
    };
    // Listening before the CLI starts: its first connection finds the port open.
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("sandbox-bridge: cannot listen on {}: {e}", args.listen))?;
    if let Some((path, port)) = &args.inbound {
        let _ = std::fs::remove_file(path);
        let inbound = UnixListener::bind(path).map_err(|e| {
            anyhow::anyhow!("sandbox-bridge: cannot listen on {}: {e}", path.display())
        })?;
        tokio::spawn(serve_inbound(inbound, *port));
    }
    let socket = Arc::new(args.socket);
    for target in &args.loopback {
        let Some(addrs) = loopback_listen(target) else {
            anyhow::bail!("sandbox-bridge: `{target}` is not a loopback host:port");
        };
        for (i, addr) in addrs.into_iter().enumerate() {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    tokio::spawn(serve_loopback(l, target.clone(), socket.clone()));
                }
                // The second address (`::1`) is a convenience: a sandbox without IPv6
                // loopback still has the first.
                Err(_) if i > 0 => {}
                Err(e) => {
                    eprintln!("sandbox-bridge: cannot listen on {addr} for {target}: {e}");
                }
            }
        }
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .spawn()
        .map_err(|e| anyhow::anyhow!("sandbox-bridge: cannot start `{program}`: {e}"))?;
    let pid = child.id().map(|p| p as libc::pid_t);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let forward = |sig: libc::c_int| {
        if let Some(pid) = pid {
            // SAFETY: signalling our own child by its pid; it is not reaped before
            // `child.wait()` returns below.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    };
    loop {
        tokio::select! {
            status = child.wait() => return Ok(status?),
            _ = term.recv() => forward(libc::SIGTERM),
            _ = int.recv() => forward(libc::SIGINT),
            accepted = listener.accept() => {
                let Ok((mut tcp, _)) = accepted else {
                    // Out of descriptors, most likely: let the open connections finish.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                let (socket, slots) = (socket.clone(), slots.clone());
                tokio::spawn(async move {
                    let Ok(_permit) = slots.acquire_owned().await else { return };
                    match UnixStream::connect(socket.as_path()).await {
                        Ok(mut unix) => {
                            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                        }
                        Err(e) => {
                            eprintln!("sandbox-bridge: the egress endpoint is unreachable: {e}");
                        }
                    }
                });
            }
        }
    }
}

/// Forward each connection to `listener` through the egress endpoint at `socket` as a
/// `CONNECT target` tunnel.
async fn serve_loopback(listener: TcpListener, target: String, socket: Arc<PathBuf>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let target = Arc::new(target);
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let (slots, target, socket) = (slots.clone(), target.clone(), socket.clone());
        tokio::spawn(async move {
            let Ok(_permit) = slots.acquire_owned().await else {
                return;
            };
            let mut tcp = tcp;
            match tunnel(&socket, &target).await {
                Ok(mut unix) => {
                    let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                }
                Err(e) => eprintln!("sandbox-bridge: {target}: {e}"),
            }
        });
    }
}

/// A tunnel to `target` through the egress endpoint: `CONNECT`, then the proxy's answer
/// read to its end; an error unless the answer is `200`.
async fn tunnel(socket: &std::path::Path, target: &str) -> std::io::Result<UnixStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut unix = UnixStream::connect(socket).await?;
    unix.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    // Byte by byte: nothing after the answer's head may be read here (it is the tunnel's).
    let mut head = Vec::with_capacity(128);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_ANSWER || unix.read(&mut byte).await? == 0 {
            return Err(std::io::Error::other("the egress endpoint did not answer"));
        }
        head.push(byte[0]);
    }
    let status = head.split(|b| *b == b' ').nth(1).unwrap_or_default();
    if status != b"200" {
        let line = String::from_utf8_lossy(head.split(|b| *b == b'\r').next().unwrap_or_default())
            .into_owned();
        return Err(std::io::Error::other(format!(
            "refused by the egress proxy: {line}"
        )));
    }
    Ok(unix)
}

/// Forward each connection to `inbound` to loopback port `port` (the server reaching a
/// CLI's own server from outside the network namespace).
async fn serve_inbound(inbound: UnixListener, port: u16) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((mut unix, _)) = inbound.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let slots = slots.clone();
        tokio::spawn(async move {
            let Ok(_permit) = slots.acquire_owned().await else {
                return;
            };
            // Refused while the CLI is still starting: the server's caller tries again.
            if let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)).await {
                let _ = tokio::io::copy_bidirectional(&mut unix, &mut tcp).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forward_listens_where_its_target_is_inside() {
        let both = |p: u16| {
            Some(vec![
                SocketAddr::from(([127, 0, 0, 1], p)),
                SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, p)),
            ])
        };
        assert_eq!(loopback_listen("127.0.0.1:8787"), both(8787));
        assert_eq!(loopback_listen("localhost:8787"), both(8787));
        assert_eq!(
            loopback_listen("[::1]:9"),
            Some(vec![SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 9))])
        );
        assert_eq!(
            loopback_listen("127.0.0.2:9"),
            Some(vec![SocketAddr::from(([127, 0, 0, 2], 9))])
        );
        for bad in [
            "10.0.0.7:9",
            "example.com:9",
            "127.0.0.1",
            "127.0.0.1:0",
            "[::1]",
        ] {
            assert_eq!(loopback_listen(bad), None, "{bad}");
        }
    }
}
