//! `agentry-mock`: the built-in `mock` provider's agent, the same as `agentry mock-agent`,
//! in an executable of its own so that each mock agent maps a few megabytes instead of
//! the whole server. The server runs it when it is installed beside `agentry`.

fn main() {
    // One agent per process: a single-threaded runtime is all it needs, and many of them
    // run beside the server.
    let served = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(agentry::providers::mock::run_stdio()));
    if let Err(e) = served {
        eprintln!("agentry-mock: {e:#}");
        std::process::exit(1);
    }
}
