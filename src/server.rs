//! Application wiring: settings → database (embedded or external) → migrations → boot
//! reconciliation → event writer, runtime and HTTP server. `main` and the tests build the
//! same `Application`; tests hand it a listener on port 0 and their own pool.

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{App, HttpServer, web};
use anyhow::Context;
use sqlx::PgPool;
use tokio::runtime::Handle;
use tokio::sync::watch;
use utoipa_actix_web::AppExt;

use crate::api::{self, AppState};
use crate::auth::tokens;
use crate::config::Settings;
use crate::egress::{Egress, EgressLimits};
use crate::embedded_pg::{EmbeddedOptions, EmbeddedPostgres};
use crate::events::{Bus, EventWriter, Fanout, WriterLimits};
use crate::process::Ledger;
use crate::providers::ProviderRegistry;
use crate::runtime::{AgentManager, ReplicaLock, reconcile_at_boot};
use crate::services::network::EgressPolicy;
use crate::services::{
    Access, Data, Fleet, Governance, Lifecycle, Repositories, ServiceContext, cluster, hooks,
    secrets,
};
use crate::store;

/// How the binary's allocator gives memory it holds free back to the system; set once by
/// `main`, which chose the allocator. Without it (tests, other embedders) nothing is done.
static RELEASE_FREED: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets how [`release_freed`] gives free memory back; the first call wins.
pub fn on_release_freed(release: fn()) {
    let _ = RELEASE_FREED.set(release);
}

/// Gives back what the calling thread has just freed. Called where the server drops a
/// lot at once that it will not need again: each HTTP worker's route table is built with
/// the whole OpenAPI description of its routes, which is then dropped. An allocator keeps
/// such pages for the thread until it allocates again, and an idle worker never does.
fn release_freed() {
    if let Some(release) = RELEASE_FREED.get() {
        release();
    }
}

pub struct Application {
    port: u16,
    server: actix_web::dev::Server,
    state: web::Data<AppState>,
    shutdown: watch::Sender<bool>,
    embedded: Option<EmbeddedPostgres>,
    bootstrap_token: Option<String>,
    lock: ReplicaLock,
    /// Turns stored moments into outbox rows.
    moments_task: tokio::task::JoinHandle<()>,
    /// Delivers the outbox.
    delivery_task: tokio::task::JoinHandle<()>,
    /// Acts on received webhook deliveries; on shutdown it gives back what it holds.
    trigger_worker: tokio::task::JoinHandle<()>,
    /// The heartbeat and the listener for other replicas' events.
    cluster_tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Connect to the configured database, or start the embedded one.
pub async fn open_database(
    settings: &Settings,
) -> anyhow::Result<(PgPool, Option<EmbeddedPostgres>)> {
    match &settings.database.url {
        Some(url) => {
            let opts: sqlx::postgres::PgConnectOptions = url
                .expose()
                .parse()
                .context("invalid setting `database.url`")?;
            let pool = store::connect(opts, settings.database.pool_size())
                .await
                .context("cannot connect to the database at `database.url`")?;
            Ok((pool, None))
        }
        None => {
            std::fs::create_dir_all(&settings.data_dir).with_context(|| {
                format!("cannot create data_dir {}", settings.data_dir.display())
            })?;
            let pg = EmbeddedPostgres::start(EmbeddedOptions {
                data_dir: settings.data_dir.clone(),
                ephemeral: false,
            })
            .await?;
            pg.ensure_database("agentry").await?;
            let pool = store::connect(pg.connect_options("agentry"), settings.database.pool_size())
                .await?;
            Ok((pool, Some(pg)))
        }
    }
}

/// For commands run beside a server (`migrate`, `token create`): use the embedded cluster
/// the server is running, or start it when no server runs.
pub async fn open_database_beside_server(
    settings: &Settings,
) -> anyhow::Result<(PgPool, Option<EmbeddedPostgres>)> {
    if settings.database.url.is_none()
        && let Some(opts) = EmbeddedPostgres::running(&settings.data_dir, "agentry")
        && let Ok(pool) = store::connect(opts, 2).await
    {
        return Ok((pool, None));
    }
    open_database(settings).await
}

impl Application {
    /// Build from settings alone: the database from settings, the listener on `listen`.
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let (pool, embedded) = open_database(&settings).await?;
        let addr = settings.listen_addr()?;
        let listener =
            TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        Self::build_with(settings, pool, embedded, listener).await
    }

    pub async fn build_with(
        settings: Settings,
        pool: PgPool,
        embedded: Option<EmbeddedPostgres>,
        listener: TcpListener,
    ) -> anyhow::Result<Self> {
        crate::telemetry::install_crypto_provider();
        // Before anything changes the database: a second server with this replica's id
        // refuses to start.
        let replica = settings.replica();
        let lock = ReplicaLock::acquire(&pool, &replica).await?;
        store::migrate(&pool)
            .await
            .context("cannot apply database migrations")?;
        // Alive in the others' eyes before reconciling, so none of them takes this
        // replica's agents over meanwhile.
        let advertise_url = advertise_url(&settings, &listener)?;
        store::replicas::register(
            &pool,
            &replica,
            &advertise_url,
            settings.cluster.lease_ttl_s as i64,
        )
        .await?;
        std::fs::create_dir_all(settings.data_dir.join("worktrees"))
            .with_context(|| format!("cannot create {}/worktrees", settings.data_dir.display()))?;
        let bootstrap_token = bootstrap_admin(&pool, &settings.data_dir).await?;

        let bus = Arc::new(Bus::new(settings.events.subscriber_buffer));
        // The writer has connections of its own: a commit never waits in line with
        // requests and agents for the shared pool (while 1,000 agents were being opened,
        // that wait doubled the time of each commit).
        let writer_pool =
            store::connect((*pool.connect_options()).clone(), store::WRITER_CONNECTIONS)
                .await
                .context("cannot open the event writer's database connections")?;
        let writer = EventWriter::spawn(
            writer_pool,
            bus.clone(),
            WriterLimits {
                max_batch: settings.events.batch_max_events,
                linger: Duration::from_millis(settings.events.batch_linger_ms),
                team_linger: Duration::from_millis(settings.events.team_linger_ms),
                max_queued_events: settings.events.queue_max_events,
                max_queued_bytes: settings.events.queue_max_bytes,
                commit_wait: Duration::from_millis(settings.events.commit_wait_ms),
            },
        );
        // Tell other replicas about commits, and hear theirs, before anyone subscribes.
        let fanout = Fanout::start(pool.clone(), replica.clone());
        bus.attach_fanout(fanout.clone());
        let listener_task = tokio::spawn(crate::events::listen_to_replicas(
            pool.clone(),
            bus.clone(),
            fanout.clone(),
        ));
        let capacity = crate::config::HostCapacity::measure();
        tracing::info!(
            cpus = capacity.cpus,
            memory_mib = capacity.memory_mib,
            default = capacity.running_turns(),
            max_running_turns = settings.limits.max_running_turns,
            max_running_turns_per_team = settings.limits.max_running_turns_per_team,
            "running-turn limits (0: none)"
        );
        tracing::info!(
            max_connections = settings.database.pool_size(),
            "database pool"
        );
        let limit_host = crate::process::limits::LimitHost::detect(&replica);
        tracing::info!("limits: {}", limit_host.describe());
        // The `agentry` executable: this one, unless the server is embedded in another
        // program that names it. Its `agentry-sandbox` launches children and runs the
        // sandboxes' bridge.
        let agentry_exe = match &settings.bridge_program {
            Some(p) => Some(p.clone()),
            None => std::env::current_exe().ok(),
        };
        let launcher = agentry_exe
            .as_deref()
            .and_then(crate::process::sandbox_helper);
        if launcher.is_none() {
            tracing::info!(
                "agentry-sandbox is not installed beside agentry: agents' processes start from a copy of the server (slower)"
            );
        }
        let ledger = Ledger::new(pool.clone(), replica.clone())
            .with_tmp_root(settings.data_dir.join("tmp"))
            .with_limits(limit_host, agent_limits(&settings.agents.limits)?)
            .with_launcher(launcher);
        let report = reconcile_at_boot(&pool, &writer, &ledger, &lock).await?;
        if report.agents_closed + report.processes_killed + report.turns_failed > 0 {
            tracing::info!(?report, "reconciled what the previous run left");
        }
        let (keyring, key_source) =
            secrets::Keyring::from_settings(&settings.secrets, &settings.data_dir)?;
        secrets::announce_key(
            &pool,
            &keyring,
            &key_source,
            settings.database.url.is_some(),
        )
        .await;
        let registry =
            ProviderRegistry::from_settings_in(&settings.providers, Some(&settings.data_dir))?;
        let provider_ids: Vec<String> = registry.all().map(|p| p.info().id).collect();
        let egress_policy =
            EgressPolicy::from_settings(&settings.egress, provider_ids.iter().map(String::as_str))
                .map_err(anyhow::Error::msg)?;
        let (egress, denials) = Egress::start_with(
            settings.data_dir.join("egress"),
            EgressLimits {
                max_connections_per_agent: settings.egress.max_connections_per_agent,
                idle_timeout: Duration::from_secs(settings.egress.idle_timeout_s),
                ..EgressLimits::default()
            },
        );
        let egress = match agentry_exe {
            Some(p) => egress.with_bridge_program(p),
            None => egress,
        };
        let agents = AgentManager::new(
            pool.clone(),
            writer.clone(),
            registry,
            ledger,
            Handle::current(),
        )
        .with_idle_timeout(
            (settings.agents.idle_timeout_s > 0)
                .then(|| Duration::from_secs(settings.agents.idle_timeout_s)),
        )
        .with_lease_ttl(Duration::from_secs(settings.cluster.lease_ttl_s))
        .with_agent_nice(settings.agents.nice)
        .with_sandbox(std::sync::Arc::new(sandbox_at_start(&settings)))
        .with_egress(egress.clone());
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let oidc = match &settings.auth.oidc {
            Some(o) => Some(crate::auth::oidc::Oidc::start(
                o.clone(),
                &Handle::current(),
            )?),
            None => None,
        };
        // Principals of API tokens are held while this replica hears what changes them.
        let tokens = Arc::new(crate::auth::TokenCache::default());
        let tokens_task = tokio::spawn({
            let (tokens, pool) = (tokens.clone(), pool.clone());
            async move { tokens.listen(pool).await }
        });
        // What the request path knows of the store's health: a probe watches it, and the
        // supervisor of the embedded database says when that one is down and why.
        let health = Arc::new(store::StoreHealth::new());
        if let Some(pg) = &embedded {
            pg.supervise(health.clone());
            health.measure_space_with(pg.space_meter());
        }
        writer.report_to(health.clone());
        let health_task = tokio::spawn({
            let (health, options) = (health.clone(), (*pool.connect_options()).clone());
            async move { health.watch(options).await }
        });
        let pool = store::DeadlinePool::new(
            pool,
            Duration::from_millis(settings.database.statement_deadline_ms),
        )
        .with_health(health);
        let state = web::Data::new(AppState {
            services: ServiceContext {
                data: Data {
                    audit: crate::services::audit::AuditLog::spawn(pool.clone()),
                    pool,
                    writer,
                    bus,
                },
                access: Access {
                    tokens,
                    oidc,
                    secrets: Arc::new(keyring),
                    revalidate: Duration::from_secs(settings.events.revalidate_s),
                },
                // Built before `agentry_mcp_url`: of the two, its error is the one reported.
                hooks: Arc::new(hooks::Hooks::new(&settings.hooks)?),
                fleet: Fleet {
                    agents,
                    limits: settings.limits.clone(),
                    bounds: Arc::new(crate::services::bounds::Bounds::new(
                        &settings.limits,
                        &settings.mcp,
                    )),
                    egress_policy: Arc::new(egress_policy),
                    agentry_mcp_url: Some(agentry_mcp_url(&settings, &listener)?),
                },
                repos: Repositories {
                    projects: settings.projects.clone(),
                    workspaces: settings.workspaces.clone(),
                    data_dir: settings.data_dir.clone(),
                },
                governance: Governance {
                    usage: Arc::new(crate::services::usage::UsageBook::new(&settings.usage)),
                    queue: Default::default(),
                },
                lifecycle: Lifecycle {
                    runtime: Handle::current(),
                    shutdown: shutdown_rx,
                },
                triggers: Arc::new(crate::services::triggers::Triggers::new(&settings.triggers)),
            },
            settings: settings.clone(),
            http: Default::default(),
            mcp: Default::default(),
            egress,
        });

        if settings.usage.ledger {
            state
                .services
                .fleet
                .agents
                .set_spend(crate::services::usage::Metering::new(&state.services));
        } else {
            tracing::warn!("usage.ledger is off: turns are not recorded and budgets do not hold");
        }
        let port = listener.local_addr()?.port();
        cluster::join(&state.services.data, &state.services.fleet, &fanout).await?;
        let cluster_tasks = vec![
            health_task,
            listener_task,
            tokens_task,
            tokio::spawn(cluster::run(state.services.clone(), fanout, advertise_url)),
            tokio::spawn(crate::services::idempotency::run_purge(
                state.services.data.clone(),
                state.services.lifecycle.clone(),
            )),
            tokio::spawn(record_denials(denials, state.services.fleet.agents.clone())),
        ];
        if let Err(e) = crate::services::setup::fail_interrupted(&state.services, &replica).await {
            tracing::warn!(error = %e, "could not close the setups the previous run left running");
        }
        let sealed =
            crate::services::mcp::seal_stored(&state.services.data, &state.services.access).await;
        match sealed {
            Ok(0) => {}
            Ok(n) => tracing::info!(agents = n, "sealed MCP header values stored in the clear"),
            Err(e) => tracing::warn!(error = %e, "could not seal stored MCP header values"),
        }
        hooks::sync_settings_hooks(&state.services, &settings.hooks.server).await?;
        // Notifications: the moments stored with agents' events become outbox rows, the
        // worker sends them.
        let moments_task = tokio::spawn(hooks::run_moments(state.services.clone()));
        let delivery_task = tokio::spawn(hooks::run_worker(state.services.clone()));
        // Queued prompts: started when their agent or a running-turn slot is free.
        let mut cluster_tasks = cluster_tasks;
        cluster_tasks.push(tokio::spawn(crate::services::queue::run(
            state.services.clone(),
        )));
        // Schedules: each replica claims the due slots of cron triggers.
        cluster_tasks.push(tokio::spawn(crate::services::triggers::run_scheduler(
            state.services.clone(),
        )));
        // The open pull requests' state and checks, read again from their forges.
        cluster_tasks.push(tokio::spawn(crate::services::ci::run_pr_poll(
            state.services.clone(),
        )));
        // Webhook deliveries are answered at once; this worker acts on them.
        let trigger_worker =
            state
                .services
                .lifecycle
                .runtime
                .spawn(crate::services::triggers::run_worker(
                    state.services.clone(),
                ));

        let data = state.clone();
        let max_body = settings.limits.max_body_bytes;
        let server = HttpServer::new(move || {
            let (app, description) = App::new()
                .into_utoipa_app()
                .openapi(api::docs::base())
                .app_data(data.clone())
                .configure(|cfg| api::configure(cfg, max_body))
                .split_for_parts();
            drop(description);
            release_freed();
            app.wrap(actix_web::middleware::from_fn(api::metrics::record))
                .wrap(actix_web::middleware::from_fn(api::middleware::catch_panic))
                .wrap(actix_web::middleware::from_fn(api::middleware::request_id))
                .route("/openapi.json", web::get().to(api::docs::served_document))
                .service(api::docs::swagger())
                .configure(api::ui::configure)
                .configure(api::mcp::configure)
                .route("/docs", web::get().to(api::docs::redirect_to_ui))
                .default_service(web::to(api::docs::fallback))
        })
        .workers(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .min(4),
        )
        .tcp_nodelay(true)
        .disable_signals()
        .shutdown_timeout(10)
        .listen(listener)?
        .run();

        Ok(Self {
            port,
            server,
            state,
            shutdown: shutdown_tx,
            embedded,
            bootstrap_token,
            lock,
            moments_task,
            delivery_task,
            trigger_worker,
            cluster_tasks,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bootstrap admin token, when this start created it.
    pub fn bootstrap_token(&self) -> Option<&str> {
        self.bootstrap_token.as_deref()
    }

    pub fn state(&self) -> web::Data<AppState> {
        self.state.clone()
    }

    /// Serve until `stop` resolves, then shut down in order: streams, agents (their
    /// processes end), the HTTP server, the embedded database.
    pub async fn run_until(
        self,
        stop: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let handle = self.server.handle();
        let server = tokio::spawn(self.server);
        stop.await;
        tracing::info!("shutting down");
        let _ = self.shutdown.send(true);
        let drain = Duration::from_secs(self.state.settings.cluster.drain_timeout_s);
        self.state.services.fleet.agents.shutdown(drain).await;
        self.state.egress.close_all();
        // The trigger runs in hand are given back as pending while the database is
        // still there.
        let mut trigger_worker = self.trigger_worker;
        if tokio::time::timeout(Duration::from_secs(5), &mut trigger_worker)
            .await
            .is_err()
        {
            tracing::warn!(
                "the trigger worker did not stop in time; its runs are taken again once their lease lapses"
            );
            trigger_worker.abort();
            let _ = trigger_worker.await;
        }
        for task in self.cluster_tasks {
            task.abort();
            let _ = task.await;
        }
        cluster::leave(&self.state.services.data, &self.state.services.fleet).await;
        // The moments of the agents just closed go to the outbox now (what is left is
        // handled at the next start), before the HTTP server stops: pooled connections
        // opened by its workers end with the workers' runtimes. The moments task is
        // ended first so that it does not run beside this last pass; the delivery worker
        // ends on the shutdown signal (a delivery cut short stays pending and is sent
        // again after its lease).
        self.moments_task.abort();
        let _ = self.moments_task.await;
        match tokio::time::timeout(
            Duration::from_secs(5),
            hooks::outbox_moments(&self.state.services),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not queue the last moments' notifications; they are queued at the next start");
            }
            Err(_) => {
                tracing::warn!(
                    "queuing the last moments' notifications took too long; the rest are queued at the next start"
                );
            }
        }
        self.delivery_task.abort();
        let _ = self.delivery_task.await;
        handle.stop(true).await;
        let _ = server.await;
        self.state.services.data.pool.pool().close().await;
        self.lock.release().await;
        if let Some(pg) = self.embedded {
            pg.stop().await?;
        }
        Ok(())
    }
}

/// Every connection the egress proxy refused an agent becomes a `network_denied` event in
/// its timeline (a run of setup or teardown commands hears its own, see
/// `services::setup`).
async fn record_denials(
    mut denials: tokio::sync::mpsc::Receiver<crate::egress::Denial>,
    agents: AgentManager,
) {
    while let Some(d) = denials.recv().await {
        let crate::egress::Holder::Agent(agent) = d.holder else {
            continue;
        };
        if !agents
            .record_network_denial(agent, d.host, d.port, d.reason.as_str())
            .await
        {
            tracing::debug!(agent_id = %agent, "a refused connection of an agent not running here");
        }
    }
}

/// How other replicas reach this one: `cluster.advertise_url`, else `http://` and the
/// address it listens on (the host name for an unspecified address).
/// `[agents.limits]` as the limits of each agent's process tree.
fn agent_limits(
    s: &crate::config::AgentLimitsSettings,
) -> anyhow::Result<crate::process::limits::ResourceLimits> {
    Ok(crate::process::limits::ResourceLimits {
        memory_bytes: s
            .memory_bytes()
            .map_err(|m| anyhow::anyhow!("invalid setting `agents.limits.memory`: {m}"))?,
        max_processes: (s.max_processes > 0).then_some(s.max_processes),
        cpu_weight: Some(s.cpu_weight),
        open_files: (s.open_files > 0).then_some(s.open_files),
    })
}

/// Where an agent's process reaches this server's `/mcp`: `agents.agentry_mcp_url`, else
/// the loopback address on the port it listens on when it listens on a loopback or
/// unspecified address (agents share the host's network by default), else that address.
fn agentry_mcp_url(settings: &Settings, listener: &TcpListener) -> anyhow::Result<String> {
    if let Some(url) = &settings.agents.agentry_mcp_url {
        return Ok(url.clone());
    }
    let addr = listener.local_addr()?;
    let host = match addr.ip() {
        ip if ip.is_unspecified() || ip.is_loopback() => {
            if ip.is_ipv6() && !ip.is_unspecified() {
                "[::1]".to_owned()
            } else {
                "127.0.0.1".to_owned()
            }
        }
        ip if ip.is_ipv6() => format!("[{ip}]"),
        ip => ip.to_string(),
    };
    Ok(format!("http://{host}:{}/mcp", addr.port()))
}

fn advertise_url(settings: &Settings, listener: &TcpListener) -> anyhow::Result<String> {
    if let Some(url) = &settings.cluster.advertise_url {
        return Ok(url.trim_end_matches('/').to_owned());
    }
    let addr = listener.local_addr()?;
    let host = if addr.ip().is_unspecified() {
        std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into())
    } else if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    Ok(format!("http://{host}:{}", addr.port()))
}

/// In local mode: on first start, create the admin, the default team and a bootstrap
/// token; print the token once and write it to `<data_dir>/admin-token` (0600).
async fn bootstrap_admin(pool: &PgPool, data_dir: &Path) -> anyhow::Result<Option<String>> {
    let mut tx = pool.begin().await?;
    // Serialise concurrent first starts.
    sqlx::query("SELECT pg_advisory_xact_lock(7243001)")
        .execute(&mut *tx)
        .await?;
    if store::identity::find_user_by_email(&mut *tx, ADMIN_EMAIL)
        .await?
        .is_some()
    {
        return Ok(None);
    }
    let user = uuid::Uuid::now_v7();
    store::identity::insert_user(&mut *tx, user, ADMIN_EMAIL, "Local admin", true).await?;
    let team = match store::identity::find_team_by_name(&mut *tx, "default").await? {
        Some(t) => t,
        None => {
            let t = uuid::Uuid::now_v7();
            store::identity::insert_team(&mut *tx, t, "default").await?;
            t
        }
    };
    store::identity::upsert_member(&mut *tx, team, user, "owner").await?;
    let token = tokens::generate();
    store::identity::insert_token(
        &mut *tx,
        uuid::Uuid::now_v7(),
        user,
        None,
        None,
        "bootstrap admin",
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &[],
        None,
    )
    .await?;
    tx.commit().await?;
    write_admin_token(data_dir, &token)?;
    Ok(Some(token))
}

pub const ADMIN_EMAIL: &str = "admin@localhost";

pub fn write_admin_token(data_dir: &Path, token: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(data_dir)?;
    let path = data_dir.join("admin-token");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(f, "{token}")?;
    Ok(())
}

/// Issue a new admin token straight in the database (`agentry token create --admin`).
pub async fn create_admin_token(pool: &PgPool, name: &str) -> anyhow::Result<String> {
    let user = match store::identity::find_user_by_email(pool, ADMIN_EMAIL).await? {
        Some(u) => u.id,
        None => anyhow::bail!("no local admin exists yet: start the server once first"),
    };
    let token = tokens::generate();
    store::identity::insert_token(
        pool,
        uuid::Uuid::now_v7(),
        user,
        None,
        None,
        name,
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &[],
        None,
    )
    .await?;
    Ok(token)
}

/// Probe once whether this host can sandbox agents, and say what it found.
fn sandbox_at_start(settings: &Settings) -> crate::sandbox::Sandbox {
    use crate::config::SandboxMode;
    let sandbox = crate::sandbox::Sandbox::probe(
        &settings.sandbox,
        &settings.data_dir,
        settings.config_file.as_deref(),
    );
    let status = sandbox.status();
    match (status.mode, &status.reason) {
        (SandboxMode::Enforce, None) => {
            tracing::info!(network = ?status.network, "agent processes run sandboxed (bwrap)");
        }
        (SandboxMode::Enforce, Some(reason)) => {
            tracing::error!(%reason, allow_unconfined_unattended = settings.sandbox.allow_unconfined_unattended,
                "this host cannot sandbox agents: they run UNCONFINED; unattended modes are refused unless sandbox.allow_unconfined_unattended is set");
        }
        (SandboxMode::Off, _) => {
            tracing::warn!(
                allow_unconfined_unattended = settings.sandbox.allow_unconfined_unattended,
                "sandbox.mode = \"off\": agents run UNCONFINED; unattended modes are refused unless sandbox.allow_unconfined_unattended is set"
            );
        }
    }
    sandbox
}
