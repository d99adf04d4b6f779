//! The `agentry` command line: its arguments and what each command runs. `main.rs` only
//! calls [`main`].
//!
//! It lives in the library rather than in `main.rs` for the build's sake: the futures of
//! async functions are compiled in the crate that polls them, not shared across crates,
//! so when `main.rs` ran the server, the bench and the other commands with `block_on`,
//! the release build compiled every async function they reach a second time for the
//! binary (48 s of CPU, after the library, in a quickstart build). Polled here, they are
//! compiled once, with the library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::Settings;

#[derive(Parser)]
#[command(
    name = "agentry",
    version,
    about = "A team server that runs AI coding agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    connection: crate::client::Connection,
}

#[derive(clap::Args, Clone)]
struct ConfigArgs {
    /// A TOML settings file.
    #[arg(long, env = "AGENTRY_CONFIG")]
    config: Option<PathBuf>,
    /// Where agentry keeps its state.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server (embedded PostgreSQL unless DATABASE_URL is set).
    Serve {
        #[command(flatten)]
        config: ConfigArgs,
        /// Address to listen on (default 127.0.0.1:8080).
        #[arg(long)]
        listen: Option<String>,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// Manage API tokens directly in the database (on the server host).
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Team secrets: keys and rotation (run on the server host).
    Secrets {
        #[command(subcommand)]
        command: SecretsCommand,
    },
    /// The mock ACP agent on stdio (used by the built-in `mock` provider).
    MockAgent,
    /// Inside an agent's sandbox: forward a loopback port to the egress endpoint and run
    /// the CLI given after `--`.
    #[command(hide = true)]
    SandboxBridge {
        /// `--listen ADDR --socket PATH [--inbound PATH --inbound-port PORT]
        /// [--loopback HOST:PORT]... -- ARGV...` (see `egress::bridge::BridgeArgs::parse`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 1..)]
        args: Vec<String>,
    },
    /// Measure durable event throughput, SSE latency and memory.
    Bench(crate::bench::BenchArgs),
    #[command(flatten)]
    Client(crate::client::ClientCommand),
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Issue a new admin token (when the bootstrap token is lost or revoked).
    Create {
        #[command(flatten)]
        config: ConfigArgs,
        /// Required: the token is for the local admin.
        #[arg(long)]
        admin: bool,
        #[arg(long, default_value = "admin (cli)")]
        name: String,
    },
}

#[derive(Subcommand)]
enum SecretsCommand {
    /// Re-encrypt every stored team secret under the current `secrets.key` (values under
    /// a key in `secrets.previous_keys` are opened with it). Safe beside a running server.
    Rotate {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Print a new random key for `secrets.key` (base64 of 32 bytes).
    NewKey,
}

fn load_settings(args: &ConfigArgs, listen: Option<String>) -> anyhow::Result<Settings> {
    let mut settings = Settings::load(args.config.as_deref())?;
    if let Some(d) = &args.data_dir {
        settings.data_dir = std::path::absolute(d)?;
    }
    if let Some(l) = listen {
        settings.listen = l;
        settings.listen_addr()?;
    }
    Ok(settings)
}

/// Parse the command line and run the command.
pub fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    crate::telemetry::install_crypto_provider();
    if let Command::MockAgent = cli.command {
        // One agent per process: a single-threaded runtime is all it needs, and many of
        // them run beside the server.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return rt.block_on(crate::providers::mock::run_stdio());
    }
    if let Command::SandboxBridge { args } = &cli.command {
        return crate::egress::bridge::run(crate::egress::bridge::BridgeArgs::parse(args)?);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::MockAgent | Command::SandboxBridge { .. } => unreachable!("handled above"),
        Command::Client(command) => {
            let code = crate::client::main(cli.connection, command, &rt);
            std::process::exit(code);
        }
        Command::Openapi => {
            print!("{}", crate::api::docs::document_json());
            Ok(())
        }
        Command::Serve { config, listen } => {
            let settings = load_settings(&config, listen)?;
            let _telemetry = crate::telemetry::init(&settings.log);
            rt.block_on(serve(settings))
        }
        Command::Migrate { config } => {
            let settings = load_settings(&config, None)?;
            let _telemetry = crate::telemetry::init(&settings.log);
            rt.block_on(async {
                let (pool, pg) = crate::server::open_database_beside_server(&settings).await?;
                crate::store::migrate(&pool).await?;
                pool.close().await;
                if let Some(pg) = pg {
                    pg.stop().await?;
                }
                println!("migrations applied");
                Ok(())
            })
        }
        Command::Token {
            command:
                TokenCommand::Create {
                    config,
                    admin,
                    name,
                },
        } => {
            anyhow::ensure!(
                admin,
                "only `agentry token create --admin` is supported; create other tokens over the API"
            );
            let settings = load_settings(&config, None)?;
            let _telemetry = crate::telemetry::init(&settings.log);
            rt.block_on(async {
                let (pool, pg) = crate::server::open_database_beside_server(&settings).await?;
                crate::store::migrate(&pool).await?;
                let token = crate::server::create_admin_token(&pool, &name).await?;
                pool.close().await;
                if let Some(pg) = pg {
                    pg.stop().await?;
                }
                println!("{token}");
                Ok(())
            })
        }
        Command::Secrets {
            command: SecretsCommand::NewKey,
        } => {
            println!("{}", crate::services::secrets::new_key()?);
            Ok(())
        }
        Command::Secrets {
            command: SecretsCommand::Rotate { config },
        } => {
            let settings = load_settings(&config, None)?;
            let _telemetry = crate::telemetry::init(&settings.log);
            rt.block_on(rotate_secrets(settings))
        }
        Command::Bench(args) => {
            crate::telemetry::init(&crate::config::LogSettings {
                filter: "warn".into(),
                ..Default::default()
            });
            rt.block_on(crate::bench::run(args))
        }
    }
}

async fn rotate_secrets(settings: Settings) -> anyhow::Result<()> {
    use crate::services::secrets::{self, KeySource, Keyring};
    let (keys, source) = Keyring::from_settings(&settings.secrets, &settings.data_dir)?;
    if let KeySource::Generated(path) = &source {
        // Nothing can be stored under a key that did not exist until now.
        let _ = std::fs::remove_file(path);
        anyhow::bail!(
            "no `secrets.key` is set and no generated key exists in {}: nothing to rotate to",
            settings.data_dir.display()
        );
    }
    let (pool, pg) = crate::server::open_database_beside_server(&settings).await?;
    crate::store::migrate(&pool).await?;
    let report = secrets::rotate(&pool, &keys).await;
    let hooks = crate::services::hooks::rotate(&pool, &keys).await;
    let triggers = crate::services::triggers::rotate(&pool, &keys).await;
    pool.close().await;
    if let Some(pg) = pg {
        pg.stop().await?;
    }
    let report = report?;
    println!(
        "team secrets: {} re-encrypted under key {}, {} changed meanwhile (already current), {} failed",
        report.rotated,
        keys.current_id(),
        report.skipped,
        report.failed.len()
    );
    for (team, name, why) in &report.failed {
        eprintln!("cannot re-encrypt {name} of {team}: {why}");
    }
    let (hooks_rotated, hooks_failed) = hooks?;
    println!(
        "hook secrets: {hooks_rotated} moved to the current key, {} failed",
        hooks_failed.len()
    );
    for (hook, why) in &hooks_failed {
        eprintln!("cannot re-encrypt the secret of hook {hook}: {why}; set it again (PATCH)");
    }
    let (triggers_rotated, triggers_failed) = triggers?;
    println!(
        "trigger secrets: {triggers_rotated} moved to the current key, {} failed",
        triggers_failed.len()
    );
    for (trigger, why) in &triggers_failed {
        eprintln!(
            "cannot re-encrypt the secret of trigger {trigger}: {why}; create the trigger again"
        );
    }
    anyhow::ensure!(
        report.failed.is_empty(),
        "{} team secrets could not be re-encrypted (see above); they stay unusable until \
         their key is added to `secrets.previous_keys` or they are set again",
        report.failed.len()
    );
    Ok(())
}

async fn serve(settings: Settings) -> anyhow::Result<()> {
    let app = crate::server::Application::build(settings.clone())
        .await
        .context("agentry could not start")?;
    if let Some(token) = app.bootstrap_token() {
        println!(
            "agentry: created the local admin. Bootstrap API token (shown once; also in {}):",
            settings.data_dir.join("admin-token").display()
        );
        println!("{token}");
    }
    println!(
        "agentry: listening on http://{} (API docs at /docs)",
        settings.listen
    );
    app.run_until(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    })
    .await
}
