//! The `agentry` command line: parses arguments, sets up telemetry and runs.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use agentry::config::Settings;

// The event pipeline allocates many small, short-lived JSON values; glibc's allocator
// spent a fifth of the server's time freeing them under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "agentry",
    version,
    about = "A team server that runs AI coding agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// The mock ACP agent on stdio (used by the built-in `mock` provider).
    MockAgent,
    /// Measure durable event throughput, SSE latency and memory.
    Bench(agentry::bench::BenchArgs),
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    agentry::telemetry::install_crypto_provider();
    if let Command::MockAgent = cli.command {
        // One agent per process: a single-threaded runtime is all it needs, and many of
        // them run beside the server.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return rt.block_on(agentry::providers::mock::run_stdio());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::MockAgent => unreachable!("handled above"),
        Command::Openapi => {
            print!("{}", agentry::api::docs::document_json());
            Ok(())
        }
        Command::Serve { config, listen } => {
            let settings = load_settings(&config, listen)?;
            let _telemetry = agentry::telemetry::init(&settings.log);
            rt.block_on(serve(settings))
        }
        Command::Migrate { config } => {
            let settings = load_settings(&config, None)?;
            let _telemetry = agentry::telemetry::init(&settings.log);
            rt.block_on(async {
                let (pool, pg) = agentry::server::open_database_beside_server(&settings).await?;
                agentry::store::migrate(&pool).await?;
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
            let _telemetry = agentry::telemetry::init(&settings.log);
            rt.block_on(async {
                let (pool, pg) = agentry::server::open_database_beside_server(&settings).await?;
                agentry::store::migrate(&pool).await?;
                let token = agentry::server::create_admin_token(&pool, &name).await?;
                pool.close().await;
                if let Some(pg) = pg {
                    pg.stop().await?;
                }
                println!("{token}");
                Ok(())
            })
        }
        Command::Bench(args) => {
            agentry::telemetry::init(&agentry::config::LogSettings {
                filter: "warn".into(),
                ..Default::default()
            });
            rt.block_on(agentry::bench::run(args))
        }
    }
}

async fn serve(settings: Settings) -> anyhow::Result<()> {
    let app = agentry::server::Application::build(settings.clone())
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
