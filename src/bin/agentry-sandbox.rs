//! `agentry-sandbox`: what the server runs on its own behalf around an agent's process, in
//! an executable of its own so that each start maps a few megabytes instead of the whole
//! server. The server uses it when it is installed beside `agentry`.
//!
//! - `agentry-sandbox bridge ARGS`: the egress bridge inside a sandbox, the same as
//!   `agentry sandbox-bridge ARGS` (see `agentry::egress::bridge`).
//! - `agentry-sandbox launch ARGS`: joins the child's cgroup, sets its rlimits and TERM's
//!   disposition, then execs the program (see `agentry::process::limits::Launch`). The
//!   server starts it with `posix_spawn`, so no copy of the server's memory is made.

use agentry::egress::bridge::{self, BridgeArgs};
use agentry::process::limits::{LAUNCH, Launch};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.split_first() {
        Some((command, rest)) if command == "bridge" => {
            match BridgeArgs::parse(rest).and_then(bridge::run) {
                // `run` returns only when the bridge could not start.
                Ok(()) => 1,
                Err(e) => {
                    eprintln!("{e:#}");
                    1
                }
            }
        }
        Some((command, rest)) if command == LAUNCH => {
            let e = match Launch::parse(rest) {
                Ok(launch) => {
                    let program = launch.program.clone();
                    format!("cannot start `{program}`: {}", launch.exec())
                }
                Err(e) => e.to_string(),
            };
            eprintln!("agentry-sandbox launch: {e}");
            // What a shell answers for a command it could not run.
            127
        }
        _ => {
            eprintln!("usage: agentry-sandbox bridge ARGS | agentry-sandbox launch ARGS");
            2
        }
    };
    std::process::exit(code);
}
