//! The bridge (`agentry sandbox-bridge`): the first process inside an agent's sandbox,
//! whose network namespace has nothing but loopback. It listens on a loopback port and
//! forwards every connection byte for byte to the agent's egress endpoint (a Unix socket
//! mounted into the sandbox), starts the CLI's argv with its stdio inherited, passes
//! `TERM` and `INT` on to it, and ends as the CLI ended: with its exit code, or killed by
//! the same signal. When the CLI serves the server on a loopback port (OpenCode's HTTP
//! server), the bridge also listens on a Unix socket in the endpoint's directory, which
//! the server reaches from outside, and forwards each connection to that port.

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
    pub argv: Vec<String>,
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
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .spawn()
        .map_err(|e| anyhow::anyhow!("sandbox-bridge: cannot start `{program}`: {e}"))?;
    let pid = child.id().map(|p| p as libc::pid_t);
    let socket = Arc::new(args.socket);
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
