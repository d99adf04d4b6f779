//! The README's first command as a user runs it: `agentry serve` on the embedded default,
//! as a real process, with a real signal to stop it.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_agentry");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Server {
    child: Child,
    base: String,
    printed_token: Option<String>,
}

fn serve(data_dir: &Path) -> Server {
    let port = free_port();
    let mut child = Command::new(EXE)
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed_token = None;
    loop {
        let line = lines.next().expect("serve printed its address").unwrap();
        if line.starts_with("agt_pat_") {
            printed_token = Some(line.clone());
        }
        if line.contains("listening on") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
        printed_token,
    }
}

fn get(url: &str, token: &str) -> u16 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    agentry::telemetry::install_crypto_provider();
    rt.block_on(async {
        reqwest::Client::new()
            .get(url)
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    })
}

fn postmaster_of(pid: u32) -> Option<(u32, PathBuf)> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let children =
            std::fs::read_to_string(task.ok()?.path().join("children")).unwrap_or_default();
        for c in children.split_whitespace() {
            let c: u32 = c.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
            if comm.trim() == "postgres" {
                let cwd = std::fs::read_link(format!("/proc/{c}/cwd")).ok()?;
                return Some((c, cwd));
            }
        }
    }
    None
}

fn terminate(mut s: Server) -> std::process::ExitStatus {
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not stop within 30 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn serve_starts_with_no_setup_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("data");

    let server = serve(&data);
    let token_file = data.join("admin-token");
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_owned();
    assert_eq!(
        server.printed_token.as_deref(),
        Some(token.as_str()),
        "the bootstrap token is printed once"
    );
    assert_eq!(
        std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(get(&format!("{}/healthz", server.base), ""), 200);
    assert_eq!(get(&format!("{}/v1/me", server.base), &token), 200);
    let (pg, pg_data) =
        postmaster_of(server.child.id()).expect("the embedded database runs as a child");

    // A second server on the same data dir refuses instead of taking the database away.
    let second = Command::new(EXE)
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );

    // A new admin token, issued beside the running server.
    let out = Command::new(EXE)
        .args(["token", "create", "--admin", "--data-dir"])
        .arg(&data)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new_token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert_eq!(get(&format!("{}/v1/me", server.base), &new_token), 200);
    assert_eq!(
        get(&format!("{}/readyz", server.base), ""),
        200,
        "the server's database is untouched"
    );

    let status = terminate(server);
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
    assert!(
        !Path::new(&format!("/proc/{pg}")).exists()
            || std::fs::read_to_string(format!("/proc/{pg}/stat"))
                .unwrap_or_default()
                .contains(" Z "),
        "the database stopped"
    );

    // A second start reuses everything and prints no new token.
    let server = serve(&data);
    assert_eq!(server.printed_token, None);
    assert_eq!(get(&format!("{}/v1/me", server.base), &token), 200);
    assert!(terminate(server).success());
    if let Some(cluster) = pg_data.parent()
        && cluster.starts_with("/var/lib/agentry")
    {
        let _ = std::fs::remove_dir_all(cluster);
    }
}

/// Settings the server does not implement stop `serve` before it starts anything, with
/// the setting's name on stderr.
#[test]
fn serve_refuses_settings_it_does_not_implement() {
    let dir = tempfile::tempdir().unwrap();
    for (text, key) in [
        (
            "[auth.oidc]\nissuer = \"https://idp.example.com\"\naudience = [\"agentry\"]\nrefresh_tokens = true\n",
            "auth.oidc.refresh_tokens",
        ),
        (
            "[auth.oidc]\nissuer = \"https://idp.example.com\"\naudience = [\"agentry\"]\nallowed_algs = [\"HS256\"]\n",
            "auth.oidc.allowed_algs",
        ),
        (
            "[providers.my-agent]\nenabled = true\ncommand = [\"my-agent\"]\n",
            "providers.my-agent",
        ),
        ("[providers.mock]\nargs = [\"-v\"]\n", "providers.mock.args"),
    ] {
        let config = dir.path().join("agentry.toml");
        std::fs::write(&config, text).unwrap();
        let started = Instant::now();
        let out = Command::new(EXE)
            .args(["serve", "--config"])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{key}: serve started anyway");
        assert!(stderr.contains(&format!("`{key}`")), "{key}: {stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "refused at once, before any database work"
        );
        assert!(
            !dir.path().join("data").exists(),
            "nothing was created for a refused configuration"
        );
    }
}
