//! `agentry-sandbox`: what runs inside an agent's sandbox on the server's behalf, in an
//! executable of its own so that each start maps a few megabytes instead of the whole
//! server. `agentry-sandbox bridge ARGS` is `agentry sandbox-bridge ARGS` (see
//! `agentry::egress::bridge`); the server uses this one when it is installed beside it.

use agentry::egress::bridge::{self, BridgeArgs};

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
        _ => {
            eprintln!("usage: agentry-sandbox bridge --listen ADDR --socket PATH [...] -- ARGV...");
            2
        }
    };
    std::process::exit(code);
}
