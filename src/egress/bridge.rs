//! The bridge (`agentry sandbox-bridge`): the first process inside an agent's sandbox,
//! whose network namespace has nothing but loopback. It listens on a loopback port and
//! forwards every connection byte for byte to the agent's egress endpoint (a Unix socket
//! mounted into the sandbox), starts the CLI's argv with its stdio inherited, passes
//! `TERM` and `INT` on to it, and ends as the CLI ended: with its exit code, or killed by
//! the same signal.

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Semaphore;

/// Connections forwarded at once; more wait.
const MAX_CONNECTIONS: usize = 256;

/// What the bridge is told on its command line.
#[derive(Debug, Clone)]
pub struct BridgeArgs {
    pub listen: SocketAddr,
    pub socket: PathBuf,
    pub argv: Vec<String>,
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
