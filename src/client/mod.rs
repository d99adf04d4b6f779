//! The command-line client: `agentry run`, `ls`, `logs`, `send`, `approve`, `deny`,
//! `interrupt`, `diff`, `archive`, `providers`, `models` and `login`, talking to a server
//! over its REST API and event streams like any other client.
//!
//! The server and token come from `--url` / `--token`, else `AGENTRY_URL` /
//! `AGENTRY_TOKEN`, else what `agentry login` stored in `~/.config/agentry/client.toml`,
//! else `http://127.0.0.1:8080` and no token. Exit status: 0 done (a turn completed),
//! 1 a turn failed or was canceled, 2 a usage, auth, connection or server error.

pub mod api;
pub mod progress;
pub mod render;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use api::{Api, ClientError, ClientResult};
use progress::Progress;
use render::{Renderer, Style};

pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

/// Where the server is and who is calling; accepted before or after the subcommand.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Connection {
    /// The agentry server [default: what `agentry login` stored, else http://127.0.0.1:8080].
    #[arg(long, global = true, env = "AGENTRY_URL")]
    pub url: Option<String>,
    /// An API token [default: what `agentry login` stored].
    #[arg(long, global = true, env = "AGENTRY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct Json {
    /// Print the API's JSON objects (events: one per line) instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPermission {
    /// Wait for someone to answer (in the dashboard, with `agentry approve`, …).
    Wait,
    Allow,
    Deny,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// The project, by name or id.
    #[arg(long)]
    pub project: String,
    /// Work in this workspace instead of creating a new worktree.
    #[arg(long)]
    pub workspace: Option<String>,
    /// Start the new worktree from this branch, tag or commit.
    #[arg(long, conflicts_with_all = ["branch", "pr"])]
    pub base: Option<String>,
    /// Start the new worktree from this branch of the project's remote.
    #[arg(long, conflicts_with_all = ["workspace", "pr"])]
    pub branch: Option<String>,
    /// Start the new worktree from this pull request (GitHub) or merge request (GitLab)
    /// of the project's forge.
    #[arg(long, value_name = "N", conflicts_with = "workspace")]
    pub pr: Option<u32>,
    /// When the turn completes, commit what is pending and push the workspace's branch
    /// (from the server, with the project's credential).
    #[arg(long, conflicts_with = "detach")]
    pub push: bool,
    /// When the turn completes, push and open (or update) a pull request for the
    /// workspace's branch; its title is the prompt's first line.
    #[arg(long, conflicts_with = "detach")]
    pub open_pr: bool,
    #[arg(long)]
    pub provider: Option<String>,
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub mode: Option<String>,
    /// A label for the agent, `key=value`; repeat for more.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// What to do when the agent asks for permission.
    #[arg(long, value_enum, default_value = "wait")]
    pub on_permission: OnPermission,
    /// Print the agent's id and exit without waiting.
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub json: Json,
    /// The first prompt.
    pub prompt: String,
}

/// The client commands.
#[derive(clap::Subcommand, Debug)]
pub enum ClientCommand {
    /// Store the server URL and token for later commands (~/.config/agentry/client.toml):
    /// the token given with --token, else one approved in the dashboard (device sign-in;
    /// the default on a terminal), else one read from stdin.
    Login {
        /// Sign in through the dashboard: show a code, wait for someone to approve it.
        #[arg(long)]
        device: bool,
    },
    /// Create a workspace and an agent, send a prompt and follow the turn to its end.
    Run(RunArgs),
    /// List your agents.
    Ls {
        #[command(flatten)]
        json: Json,
    },
    /// Print an agent's events from the first; with -f, stay and print new ones.
    Logs {
        /// Keep following (reconnecting after a dropped connection).
        #[arg(short = 'f', long)]
        follow: bool,
        agent: String,
        #[command(flatten)]
        json: Json,
    },
    /// Send a prompt to an agent.
    Send {
        agent: String,
        prompt: String,
        /// Follow the turn to its end (exit 1 when it fails or is canceled).
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        json: Json,
    },
    /// Allow a pending permission request (the only pending one when none is named).
    Approve {
        agent: String,
        request_id: Option<String>,
    },
    /// Deny a pending permission request.
    Deny {
        agent: String,
        request_id: Option<String>,
        /// Tell the agent why.
        #[arg(long)]
        message: Option<String>,
    },
    /// Interrupt an agent's running turn.
    Interrupt { agent: String },
    /// Print the changes of an agent's workspace (or a workspace's) as a patch.
    Diff {
        /// An agent id (`agt_…`) or a workspace id (`wsp_…`).
        target: String,
        #[command(flatten)]
        json: Json,
    },
    /// Archive an agent (its timeline is kept).
    Archive { agent: String },
    /// Tokens and cost of a team's turns over a period (`GET /v1/usage`).
    Usage {
        /// The team (`team_…`); default: your default team.
        #[arg(long)]
        team: Option<String>,
        /// From this day (`YYYY-MM-DD`) or instant (RFC 3339); default: this month's start.
        #[arg(long)]
        from: Option<String>,
        /// Until this day or instant (exclusive); default: now.
        #[arg(long)]
        to: Option<String>,
        /// One line per `day`, `person`, `provider`, `model`, `project` or `parent_agent`.
        #[arg(long)]
        group_by: Option<String>,
        #[command(flatten)]
        json: Json,
    },
    /// List the providers and whether each can run.
    Providers {
        #[command(flatten)]
        json: Json,
    },
    /// List a provider's models.
    Models {
        provider: String,
        #[command(flatten)]
        json: Json,
    },
}

/// What `agentry login` stores.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    url: Option<String>,
    token: Option<String>,
}

fn config_path() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".config"),
    };
    Some(base.join("agentry").join("client.toml"))
}

fn load_stored() -> ClientResult<Stored> {
    let Some(path) = config_path() else {
        return Ok(Stored::default());
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text)
            .map_err(|e| ClientError::Usage(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Stored::default()),
        Err(e) => Err(ClientError::Usage(format!("{}: {e}", path.display()))),
    }
}

fn save_stored(stored: &Stored) -> ClientResult<PathBuf> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = config_path()
        .ok_or_else(|| ClientError::Usage("neither XDG_CONFIG_HOME nor HOME is set".into()))?;
    let fail = |e: std::io::Error| ClientError::Usage(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    let text = toml::to_string(stored).map_err(|e| ClientError::Usage(e.to_string()))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(fail)?;
    // An older file may have been readable by others.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(fail)?;
    file.write_all(text.as_bytes()).map_err(fail)?;
    Ok(path)
}

/// The server and token to use, in order: flags and environment, then the stored login,
/// then the default URL.
fn connect(conn: &Connection) -> ClientResult<Api> {
    let stored = load_stored()?;
    let url = conn
        .url
        .clone()
        .or(stored.url)
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    let token = conn
        .token
        .clone()
        .or(stored.token)
        .filter(|t| !t.is_empty());
    Api::new(&url, token)
}

/// Run a client command; the answer is the process's exit status.
pub fn main(conn: Connection, cmd: ClientCommand, rt: &tokio::runtime::Runtime) -> i32 {
    match rt.block_on(dispatch(conn, cmd)) {
        Ok(code) => code,
        Err(e) => {
            let style = Style::detect();
            eprintln!("{} {e}", style.red("agentry:"));
            2
        }
    }
}

async fn dispatch(conn: Connection, cmd: ClientCommand) -> ClientResult<i32> {
    if let ClientCommand::Login { device } = cmd {
        return login(conn, device).await;
    }
    let api = connect(&conn)?;
    match cmd {
        ClientCommand::Login { .. } => unreachable!("handled above"),
        ClientCommand::Run(args) => run(&api, args).await,
        ClientCommand::Ls { json } => ls(&api, json.json).await,
        ClientCommand::Logs {
            follow,
            agent,
            json,
        } => logs(&api, &agent, follow, json.json).await,
        ClientCommand::Send {
            agent,
            prompt,
            wait,
            json,
        } => send(&api, &agent, &prompt, wait, json.json).await,
        ClientCommand::Approve { agent, request_id } => {
            answer(&api, &agent, request_id, "allow", None).await
        }
        ClientCommand::Deny {
            agent,
            request_id,
            message,
        } => answer(&api, &agent, request_id, "deny", message).await,
        ClientCommand::Interrupt { agent } => {
            api.post(&format!("/v1/agents/{}/interrupt", id(&agent)?), &json!({}))
                .await?;
            Ok(0)
        }
        ClientCommand::Diff { target, json } => diff(&api, &target, json.json).await,
        ClientCommand::Archive { agent } => {
            api.delete(&format!("/v1/agents/{}", id(&agent)?)).await?;
            Ok(0)
        }
        ClientCommand::Usage {
            team,
            from,
            to,
            group_by,
            json,
        } => {
            let query = [
                ("team_id", team),
                ("from", from),
                ("to", to),
                ("group_by", group_by),
            ];
            usage(&api, &query, json.json).await
        }
        ClientCommand::Providers { json } => providers(&api, json.json).await,
        ClientCommand::Models { provider, json } => models(&api, &provider, json.json).await,
    }
}

/// An id as given on the command line, checked enough to keep it out of the path's
/// structure.
fn id(s: &str) -> ClientResult<&str> {
    if s.is_empty()
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(ClientError::Usage(format!("`{s}` is not an id")));
    }
    Ok(s)
}

async fn login(conn: Connection, device: bool) -> ClientResult<i32> {
    let stored = load_stored()?;
    let url = conn
        .url
        .or(stored.url)
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    let token = match conn.token {
        Some(t) => t,
        None if device || std::io::stdin().is_terminal() => device_sign_in(&url).await?,
        None => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| ClientError::Usage(format!("cannot read the token: {e}")))?;
            line.trim().to_owned()
        }
    };
    if token.is_empty() {
        return Err(ClientError::Usage(
            "no token: pass --token, set AGENTRY_TOKEN, pipe it in or use --device".into(),
        ));
    }
    let api = Api::new(&url, Some(token.clone()))?;
    let me = api.get("/v1/me").await?;
    let path = save_stored(&Stored {
        url: Some(api.base().to_owned()),
        token: Some(token),
    })?;
    println!(
        "Signed in to {} as {} (stored in {})",
        api.base(),
        me["email"].as_str().or(me["name"].as_str()).unwrap_or("?"),
        path.display()
    );
    Ok(0)
}

/// Device sign-in: ask the server for a code, show it with the dashboard page where a
/// signed-in person approves it, and poll until they do; the answer is a new token.
async fn device_sign_in(url: &str) -> ClientResult<String> {
    let api = Api::new(url, None)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty());
    let client_name = match host {
        Some(h) => format!("agentry CLI on {h}"),
        None => "agentry CLI".to_owned(),
    };
    let codes = api
        .post("/auth/device", &json!({"client_name": client_name}))
        .await?;
    let (Some(device_code), Some(user_code)) =
        (codes["device_code"].as_str(), codes["user_code"].as_str())
    else {
        return Err(ClientError::Api(format!(
            "the server answered no device code: {codes}"
        )));
    };
    let style = Style::detect();
    let mut progress = Progress::detect();
    progress.print(|| {
        eprintln!("To sign in, open this page in a browser where you are signed in to agentry:");
        eprintln!(
            "  {}",
            codes["verification_uri_complete"]
                .as_str()
                .or(codes["verification_uri"].as_str())
                .unwrap_or("")
        );
        eprintln!("and check that it shows the code {}", style.bold(user_code));
    });
    progress.set_message(format!("waiting for approval of {user_code}"));
    progress.show();
    let mut interval = codes["interval"].as_u64().unwrap_or(5).max(1);
    let expires = std::time::Instant::now()
        + std::time::Duration::from_secs(codes["expires_in"].as_u64().unwrap_or(600));
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(interval)).await;
        let (status, body) = api
            .post_status("/auth/device/token", &json!({"device_code": device_code}))
            .await?;
        if status == 200 {
            progress.hide();
            return body["access_token"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| ClientError::Api(format!("the server answered no token: {body}")));
        }
        match body["code"].as_str().unwrap_or("") {
            "authorization_pending" => {}
            "slow_down" => interval += 5,
            "access_denied" => {
                return Err(ClientError::Auth("the sign-in was denied".into()));
            }
            "expired_token" => {
                return Err(ClientError::Auth(
                    "the code expired before anyone approved it; run `agentry login` again".into(),
                ));
            }
            _ => {
                return Err(ClientError::Api(format!(
                    "the server answered {status}: {}",
                    body["detail"].as_str().unwrap_or("")
                )));
            }
        }
        if std::time::Instant::now() > expires {
            return Err(ClientError::Auth(
                "the code expired before anyone approved it; run `agentry login` again".into(),
            ));
        }
    }
}

/// The project named `p` (an id, or a name the caller's teams use exactly once).
async fn project_id(api: &Api, p: &str) -> ClientResult<String> {
    if p.starts_with("prj_") {
        return Ok(id(p)?.to_owned());
    }
    let projects = api.list("/v1/projects").await?;
    let found: Vec<&Value> = projects.iter().filter(|x| x["name"] == p).collect();
    match found.as_slice() {
        [one] => Ok(one["id"].as_str().unwrap_or_default().to_owned()),
        [] => Err(ClientError::Usage(format!("no project is named `{p}`"))),
        many => Err(ClientError::Usage(format!(
            "several projects are named `{p}`: pass one of their ids ({})",
            many.iter()
                .filter_map(|x| x["id"].as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn labels(given: &[String]) -> ClientResult<BTreeMap<String, String>> {
    given
        .iter()
        .map(|l| match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(ClientError::Usage(format!(
                "--label takes key=value (got `{l}`)"
            ))),
        })
        .collect()
}

/// The spinner for a command that waits: on a terminal, and not for `--json` (whose
/// reader is a program, perhaps writing to the same terminal).
fn spinner(json: bool) -> Progress {
    if json {
        Progress::off()
    } else {
        Progress::detect()
    }
}

/// The exit status for a turn's outcome.
fn exit_for(outcome: &str) -> i32 {
    if outcome == "completed" { 0 } else { 1 }
}

async fn run(api: &Api, args: RunArgs) -> ClientResult<i32> {
    let labels = labels(&args.labels)?;
    let project = project_id(api, &args.project).await?;
    let workspace = match &args.workspace {
        Some(w) => id(w)?.to_owned(),
        None => {
            let mut body = json!({"project_id": project});
            if let Some(base) = args.base.as_ref().or(args.branch.as_ref()) {
                body["base_ref"] = json!(base);
            }
            if let Some(n) = args.pr {
                body["pull_request"] = json!(n);
            }
            let ws = api.post("/v1/workspaces", &body).await?;
            if !args.json.json && !args.detach {
                eprintln!(
                    "workspace {} on {} ({})",
                    ws["id"].as_str().unwrap_or(""),
                    ws["branch"].as_str().unwrap_or("?"),
                    ws["path"].as_str().unwrap_or("")
                );
            }
            ws["id"].as_str().unwrap_or_default().to_owned()
        }
    };
    let mut body = json!({"workspace_id": workspace, "prompt": args.prompt, "labels": labels});
    for (key, value) in [
        ("provider", &args.provider),
        ("model", &args.model),
        ("mode", &args.mode),
    ] {
        if let Some(v) = value {
            body[key] = json!(v);
        }
    }
    let agent = api.post("/v1/agents", &body).await?;
    let agent_id = agent["id"].as_str().unwrap_or_default().to_owned();
    if args.detach {
        if args.json.json {
            println!("{agent}");
        } else {
            println!("{agent_id}");
        }
        return Ok(0);
    }
    if !args.json.json {
        eprintln!(
            "agent {agent_id} ({})",
            agent["provider"].as_str().unwrap_or("")
        );
    }
    let status = follow_turn(api, &agent_id, 0, None, args.on_permission, args.json.json).await?;
    if status != 0 || !(args.push || args.open_pr) {
        return Ok(status);
    }
    deliver(api, &workspace, &agent_id, &args).await?;
    Ok(status)
}

/// After a completed turn: push the workspace (`--push`, `--open-pr`) and open or
/// update its pull request (`--open-pr`).
async fn deliver(api: &Api, workspace: &str, agent: &str, args: &RunArgs) -> ClientResult<()> {
    let pushed = api
        .post(
            &format!("/v1/workspaces/{workspace}/push"),
            &json!({"agent_id": agent}),
        )
        .await?;
    if args.json.json {
        println!("{}", json!({"pushed": pushed}));
    } else {
        eprintln!(
            "pushed {} at {}",
            pushed["branch"].as_str().unwrap_or("?"),
            pushed["commit"].as_str().unwrap_or("?")
        );
    }
    if !args.open_pr {
        return Ok(());
    }
    let first_line = args.prompt.lines().next().unwrap_or("").trim();
    let title: String = if first_line.is_empty() {
        "Changes from agentry".to_owned()
    } else {
        first_line.chars().take(120).collect()
    };
    let ws = api
        .post(
            &format!("/v1/workspaces/{workspace}/pull-request"),
            &json!({"title": title, "body": args.prompt}),
        )
        .await?;
    let pr = &ws["opened_pull_request"];
    if args.json.json {
        println!("{}", json!({"pull_request": pr}));
    } else {
        println!("{}", pr["url"].as_str().unwrap_or(""));
    }
    Ok(())
}

/// Print the agent's events after `after` until the turn `turn` (or the first turn to
/// end, when `None`) completes; answer permission requests as `on_permission` says.
async fn follow_turn(
    api: &Api,
    agent: &str,
    after: i64,
    turn: Option<String>,
    on_permission: OnPermission,
    json: bool,
) -> ClientResult<i32> {
    let mut renderer = Renderer::new(Style::detect(), json, spinner(json));
    renderer.waiting("waiting for the agent");
    let mut outcome = String::new();
    api.follow(agent, after, async |event: Value| {
        renderer.event(&event);
        match event["kind"].as_str() {
            Some("permission_requested") if on_permission != OnPermission::Wait => {
                let behavior = if on_permission == OnPermission::Allow {
                    "allow"
                } else {
                    "deny"
                };
                let rid = event["data"]["request_id"].as_str().unwrap_or_default();
                let answered = api
                    .post(
                        &format!("/v1/agents/{agent}/permissions/{rid}"),
                        &json!({"behavior": behavior}),
                    )
                    .await;
                // Someone else may have answered first; the stream says what happened.
                if let Err(e) = answered {
                    renderer.note(&format!("agentry: could not answer {rid}: {e}"));
                }
                Ok(true)
            }
            Some("turn_completed") => {
                let ended = event["data"]["turn_id"].as_str().map(str::to_owned);
                if turn.is_none() || ended == turn {
                    outcome = event["data"]["outcome"].as_str().unwrap_or("").to_owned();
                    return Ok(false);
                }
                Ok(true)
            }
            _ => Ok(true),
        }
    })
    .await?;
    renderer.finish();
    Ok(exit_for(&outcome))
}

async fn ls(api: &Api, json: bool) -> ClientResult<i32> {
    let agents = api.list("/v1/agents").await?;
    if json {
        println!("{}", json!({"items": agents}));
        return Ok(0);
    }
    if agents.is_empty() {
        eprintln!("no agents");
        return Ok(0);
    }
    println!("{:<36}  {:<18}  {:<10}  TITLE", "ID", "STATUS", "PROVIDER");
    for a in &agents {
        let pending = a["pending_permissions"].as_i64().unwrap_or(0);
        let status = match a["status"].as_str().unwrap_or("") {
            s if pending > 0 => format!("{s} ({pending}?)"),
            s => s.to_owned(),
        };
        let title = a["title"].as_str().map(str::to_owned).unwrap_or_else(|| {
            a["labels"]
                .as_object()
                .map(|l| {
                    l.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default()
        });
        println!(
            "{:<36}  {:<18}  {:<10}  {}",
            a["id"].as_str().unwrap_or(""),
            status,
            a["provider"].as_str().unwrap_or(""),
            title
        );
    }
    Ok(0)
}

async fn logs(api: &Api, agent: &str, follow: bool, json: bool) -> ClientResult<i32> {
    let agent = id(agent)?;
    if follow {
        let mut renderer = Renderer::new(Style::detect(), json, spinner(json));
        renderer.waiting("waiting for events");
        api.follow(agent, 0, async |event: Value| {
            renderer.event(&event);
            Ok(true)
        })
        .await?;
        renderer.finish();
    } else {
        let mut renderer = Renderer::new(Style::detect(), json, Progress::off());
        let mut path = format!("/v1/agents/{agent}/timeline?after_seq=0&limit=1000");
        loop {
            let page = api.get(&path).await?;
            for e in page["items"].as_array().into_iter().flatten() {
                renderer.event(e);
            }
            match page["next_cursor"].as_str() {
                Some(c) => path = format!("/v1/agents/{agent}/timeline?cursor={c}&limit=1000"),
                None => break,
            }
        }
        renderer.finish();
    }
    Ok(0)
}

async fn send(api: &Api, agent: &str, prompt: &str, wait: bool, json: bool) -> ClientResult<i32> {
    let agent = id(agent)?;
    // Events after this one belong to what this prompt starts.
    let before = api.get(&format!("/v1/agents/{agent}")).await?["last_seq"]
        .as_i64()
        .unwrap_or(0);
    let sent = api
        .post(
            &format!("/v1/agents/{agent}/messages"),
            &json!({"text": prompt}),
        )
        .await?;
    if sent["queued"] == true {
        let mid = sent["message_id"].as_str().unwrap_or_default().to_owned();
        if json {
            println!("{sent}");
        } else {
            println!(
                "{mid} queued (position {}, waiting for {}); cancel it with DELETE /v1/agents/{agent}/messages/{mid}",
                sent["position"],
                sent["reason"].as_str().unwrap_or("its turn")
            );
        }
        if !wait {
            return Ok(0);
        }
        return follow_queued(api, agent, before, &mid, json).await;
    }
    let turn = sent["turn_id"].as_str().unwrap_or_default().to_owned();
    if !wait {
        if json {
            println!("{sent}");
        } else {
            println!("{turn}");
        }
        return Ok(0);
    }
    follow_turn(api, agent, before, Some(turn), OnPermission::Wait, json).await
}

/// Wait for queued message `mid` to leave the queue, then follow the turn it started.
async fn follow_queued(
    api: &Api,
    agent: &str,
    before: i64,
    mid: &str,
    json: bool,
) -> ClientResult<i32> {
    let mut starts: Vec<(String, i64)> = Vec::new();
    let mut started: Option<(String, i64)> = None;
    let mut left = String::new();
    api.follow(agent, before, async |event: Value| {
        match event["kind"].as_str() {
            Some("turn_started") => {
                let turn = event["data"]["turn_id"].as_str().unwrap_or_default();
                starts.push((turn.to_owned(), event["seq"].as_i64().unwrap_or(0)));
            }
            Some("message_dequeued") if event["data"]["message_id"] == mid => {
                left = event["data"]["state"].as_str().unwrap_or("").to_owned();
                let turn = event["data"]["turn_id"].as_str().unwrap_or_default();
                started = starts.iter().find(|(t, _)| t == turn).cloned();
                return Ok(false);
            }
            _ => {}
        }
        Ok(true)
    })
    .await?;
    match started {
        Some((turn, seq)) => {
            follow_turn(api, agent, seq - 1, Some(turn), OnPermission::Wait, json).await
        }
        None => {
            eprintln!("agentry: {mid} did not run ({left})");
            Ok(1)
        }
    }
}

async fn answer(
    api: &Api,
    agent: &str,
    request: Option<String>,
    behavior: &str,
    message: Option<String>,
) -> ClientResult<i32> {
    let agent = id(agent)?;
    let request = match request {
        Some(r) => id(&r)?.to_owned(),
        None => {
            let pending = api
                .get(&format!("/v1/agents/{agent}/permissions?status=pending"))
                .await?;
            let items = pending["items"].as_array().cloned().unwrap_or_default();
            match items.as_slice() {
                [one] => one["request_id"].as_str().unwrap_or_default().to_owned(),
                [] => {
                    return Err(ClientError::Usage(format!(
                        "{agent} has no pending permission request"
                    )));
                }
                many => {
                    return Err(ClientError::Usage(format!(
                        "{agent} has {} pending requests; name one: {}",
                        many.len(),
                        many.iter()
                            .map(|r| format!(
                                "{} ({})",
                                r["request_id"].as_str().unwrap_or(""),
                                r["title"].as_str().unwrap_or("")
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
            }
        }
    };
    let mut body = json!({"behavior": behavior});
    if let Some(m) = message {
        body["message"] = json!(m);
    }
    api.post(&format!("/v1/agents/{agent}/permissions/{request}"), &body)
        .await?;
    Ok(0)
}

async fn diff(api: &Api, target: &str, json: bool) -> ClientResult<i32> {
    let target = id(target)?;
    let workspace = if target.starts_with("agt_") {
        let agent = api.get(&format!("/v1/agents/{target}")).await?;
        agent["workspace_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    } else {
        target.to_owned()
    };
    let diff = api
        .get(&format!("/v1/workspaces/{}/diff", id(&workspace)?))
        .await?;
    if json {
        println!("{diff}");
    } else {
        print!("{}", diff["patch"].as_str().unwrap_or(""));
    }
    Ok(0)
}

/// `value` for a query string: every byte but the unreserved ones percent-encoded.
fn query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn usage(api: &Api, query: &[(&str, Option<String>)], json: bool) -> ClientResult<i32> {
    let params: Vec<String> = query
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", query_value(v))))
        .collect();
    let mut path = "/v1/usage".to_owned();
    if !params.is_empty() {
        path = format!("{path}?{}", params.join("&"));
    }
    let report = api.get(&path).await?;
    if json {
        println!("{report}");
        return Ok(0);
    }
    let line = |label: &str, t: &Value| {
        let estimated = t["estimated_cost_usd"].as_f64().unwrap_or(0.0);
        println!(
            "{:<36} {:>6} turns {:>12} in {:>12} out {:>12} cached  ${:.4}{}",
            label,
            t["turns"].as_i64().unwrap_or(0),
            t["input_tokens"].as_i64().unwrap_or(0),
            t["output_tokens"].as_i64().unwrap_or(0),
            t["cached_input_tokens"].as_i64().unwrap_or(0),
            t["cost_usd"].as_f64().unwrap_or(0.0),
            if estimated > 0.0 {
                format!(" (${estimated:.4} estimated)")
            } else {
                String::new()
            }
        );
    };
    println!(
        "{} from {} to {}",
        report["team_id"].as_str().unwrap_or(""),
        report["from"].as_str().unwrap_or(""),
        report["to"].as_str().unwrap_or("")
    );
    for g in report["groups"].as_array().into_iter().flatten() {
        let key = g["key"].as_str().unwrap_or("");
        line(if key.is_empty() { "(none)" } else { key }, g);
    }
    line("total", &report["totals"]);
    Ok(0)
}

async fn providers(api: &Api, json: bool) -> ClientResult<i32> {
    let list = api.get("/v1/providers").await?;
    if json {
        println!("{list}");
        return Ok(0);
    }
    let style = Style::detect();
    for p in list["items"].as_array().into_iter().flatten() {
        let available = p["available"].as_bool().unwrap_or(false);
        let state = if available {
            style.green("available")
        } else {
            style.red("unavailable")
        };
        println!(
            "{:<14} {:<24} {}{}",
            p["id"].as_str().unwrap_or(""),
            p["label"].as_str().unwrap_or(""),
            state,
            p["unavailable_reason"]
                .as_str()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    Ok(0)
}

async fn models(api: &Api, provider: &str, json: bool) -> ClientResult<i32> {
    let list = api
        .get(&format!("/v1/providers/{}/models", id(provider)?))
        .await?;
    if json {
        println!("{list}");
        return Ok(0);
    }
    for m in list["items"].as_array().into_iter().flatten() {
        let default = if m["is_default"].as_bool() == Some(true) {
            " (default)"
        } else {
            ""
        };
        println!(
            "{:<28} {}{default}",
            m["id"].as_str().unwrap_or(""),
            m["label"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}
