//! Issue 42, item 3: triggers. Signed GitHub and GitLab deliveries against a real server
//! open an agent on a labelled issue (its first prompt the filled template), send a
//! comment mentioning `@agentry` on the pull request an agent opened to that agent
//! (queued while it is busy), and tell it which check failed with an excerpt of the
//! output; a redelivery is acknowledged and not acted on twice; a bad signature is 401
//! and changes nothing; another team's trigger is missing. Cron triggers run once per
//! slot with two replicas on one database, and a slot missed while no replica ran runs
//! once at start, or is skipped. The trigger's secret is shown once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

#[allow(clippy::duplicate_mod)]
#[path = "../support/fake_forge.rs"]
mod fake_forge;
#[allow(clippy::duplicate_mod)]
#[path = "../support/git_http.rs"]
mod git_http;

use fake_forge::{FakeForge, Flavor};
use git_http::GitHttp;

const PASSWORD: &str = "triggers-remote-pass-9c2e";

fn id(v: &Value) -> &str {
    v["id"].as_str().unwrap()
}

/// A remote with repository `web`, a server that may reach it, a person owning a team
/// whose secret `WEB_GIT` holds the remote's credential, and a project on `forge`.
async fn world(flavor: Flavor) -> (GitHttp, FakeForge, TestApp, Person, String, Value) {
    world_with(flavor, |_| {}).await
}

/// Like `world`, with the server's settings changed by `tweak`.
async fn world_with(
    flavor: Flavor,
    tweak: impl FnOnce(&mut agentry::config::Settings),
) -> (GitHttp, FakeForge, TestApp, Person, String, Value) {
    let remote = GitHttp::start("git", PASSWORD).await;
    remote.create_repo("web");
    let forge = FakeForge::start(flavor, PASSWORD).await;
    let app = spawn_app_with(|s| {
        s.projects.allow_private_remotes = true;
        tweak(s);
    })
    .await;
    let ana = person(&app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    ana.api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team_a}/secrets/WEB_GIT"),
            Some(json!({ "value": format!("git:{PASSWORD}") })),
            201,
        )
        .await;
    let (kind, repo) = match flavor {
        Flavor::GitHub => ("github", "acme/web"),
        Flavor::GitLab => ("gitlab", "group/web"),
    };
    let project = ana
        .api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(
                json!({"name": "web", "team_id": team_a, "git_url": remote.url("web"),
                "credential_secret": "WEB_GIT", "forge": kind,
                "forge_api_url": forge.api_url(), "forge_repo": repo}),
            ),
            201,
        )
        .await;
    (remote, forge, app, ana, team_a, project)
}

fn signature(secret: &str, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    format!(
        "sha256={}",
        hex::encode(ring::hmac::sign(&key, body).as_ref())
    )
}

/// POSTs `body` to the trigger's webhook with `headers`; (status, answer).
async fn deliver(
    app: &TestApp,
    trigger: &Value,
    headers: &[(&str, String)],
    body: &[u8],
) -> (u16, Value) {
    let mut req = app
        .client
        .post(app.url(trigger["webhook_path"].as_str().unwrap()))
        .header("Content-Type", "application/json")
        .body(body.to_vec());
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let ct = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = res.text().await.unwrap();
    if status >= 400 {
        assert_eq!(ct.as_deref(), Some("application/problem+json"), "{text}");
    }
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Waits until run `run` of `trigger` is no longer pending or running (a worker acts on
/// it after the delivery was answered); returns it as listed.
async fn settled(app: &TestApp, trigger: &Value, run: &str) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let listed = app
            .get_ok(&format!("/v1/triggers/{}/runs?limit=200", id(trigger)))
            .await;
        let found = listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == run)
            .unwrap_or_else(|| panic!("run {run} is listed: {listed}"))
            .clone();
        if !matches!(found["state"].as_str(), Some("pending" | "running")) {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "run {run} did not end: {found}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The answer to a new delivery holds its run as recorded: pending, or done when no rule
/// applies (ignored). Its run is replaced by the run once it ended.
async fn and_settled(
    app: &TestApp,
    trigger: &Value,
    (status, mut answer): (u16, Value),
) -> (u16, Value) {
    if status == 202 {
        let run = &answer["run"];
        match run["state"].as_str() {
            Some("pending") => assert!(run["outcome"].is_null(), "{answer}"),
            Some("done") => assert_eq!(run["outcome"], "ignored", "{answer}"),
            _ => panic!("a new delivery's run is pending or ignored: {answer}"),
        }
        let id = run["id"].as_str().unwrap().to_owned();
        answer["run"] = settled(app, trigger, &id).await;
    }
    (status, answer)
}

/// A signed GitHub delivery; a new one's run as it ended.
async fn github(
    app: &TestApp,
    trigger: &Value,
    event: &str,
    delivery: &str,
    body: &Value,
) -> (u16, Value) {
    let answer = github_answer(app, trigger, event, delivery, body).await;
    and_settled(app, trigger, answer).await
}

/// A signed GitHub delivery: the answer, as soon as it comes.
async fn github_answer(
    app: &TestApp,
    trigger: &Value,
    event: &str,
    delivery: &str,
    body: &Value,
) -> (u16, Value) {
    let bytes = serde_json::to_vec(body).unwrap();
    let secret = trigger["secret"].as_str().unwrap();
    deliver(
        app,
        trigger,
        &[
            ("X-GitHub-Event", event.to_owned()),
            ("X-GitHub-Delivery", delivery.to_owned()),
            ("X-Hub-Signature-256", signature(secret, &bytes)),
        ],
        &bytes,
    )
    .await
}

/// A GitLab delivery with the trigger's token; a new one's run as it ended.
async fn gitlab(
    app: &TestApp,
    trigger: &Value,
    event: &str,
    uuid: &str,
    body: &Value,
) -> (u16, Value) {
    let answer = deliver(
        app,
        trigger,
        &[
            ("X-Gitlab-Event", event.to_owned()),
            ("X-Gitlab-Event-UUID", uuid.to_owned()),
            (
                "X-Gitlab-Token",
                trigger["secret"].as_str().unwrap().to_owned(),
            ),
        ],
        &serde_json::to_vec(body).unwrap(),
    )
    .await;
    and_settled(app, trigger, answer).await
}

async fn runs(who: &Person, trigger: &Value) -> Vec<Value> {
    who.api
        .ok(
            Method::GET,
            &format!("/v1/triggers/{}/runs?limit=200", id(trigger)),
            None,
            200,
        )
        .await["items"]
        .as_array()
        .unwrap()
        .clone()
}

/// Reads the agent's events from the first until a `user_message` containing `needle`;
/// returns its text.
async fn user_message_with(app: &TestApp, agent: &str, needle: &str) -> String {
    let mut sse = app.events(agent, None).await;
    let mut seen = Vec::new();
    loop {
        let Some(e) = sse.next(Duration::from_secs(60)).await else {
            panic!("no user_message with {needle:?} reached {agent}; saw {seen:?}");
        };
        if e.event == "user_message" {
            let text = e.data["data"]["text"].as_str().unwrap().to_owned();
            if text.contains(needle) {
                return text;
            }
            seen.push(text);
        }
    }
}

/// The agent's work is pushed and a pull request opened for it on the fake forge;
/// returns the pull request's number.
async fn open_pull_request(app: &TestApp, who: &Person, agent: &str, workspace: &str) -> i64 {
    app.wait(agent).await;
    app.prompt(agent, "/write fix.txt fixed").await;
    app.wait(agent).await;
    who.api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{workspace}/push"),
            Some(json!({})),
            200,
        )
        .await;
    let ws = who
        .api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{workspace}/pull-request"),
            Some(json!({"title": "Fix the crash"})),
            201,
        )
        .await;
    ws["opened_pull_request"]["number"]
        .as_i64()
        .unwrap_or_else(|| panic!("a pull request number in {ws}"))
}

#[tokio::test]
async fn github_deliveries_open_an_agent_reach_it_and_are_acted_on_once() {
    let (_remote, forge, app, ana, _team_a, project) = world(Flavor::GitHub).await;
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "web issues", "kind": "github", "project_id": project["id"],
                "provider": "mock",
                "rules": {"issue_labeled": {"prompt": "Fix #{{number}}: {{title}}\n{{body}}\n{{url}}"}}})),
            201,
        )
        .await;
    let secret = trigger["secret"]
        .as_str()
        .expect("the secret, once")
        .to_owned();
    assert!(secret.len() >= 32, "{trigger}");
    assert_eq!(
        trigger["webhook_path"],
        format!("/hooks/triggers/{}", id(&trigger)).as_str()
    );
    assert_eq!(
        trigger["rules"]["mention"]["handle"], "@agentry",
        "{trigger}"
    );

    // An issue labelled `agentry` opens an agent whose first prompt is the filled
    // template; a placeholder inside the issue's text stays as it is.
    let issue = json!({"action": "labeled", "label": {"name": "agentry"},
        "issue": {"number": 42, "title": "Login crashes", "body": "Steps: {{title}} twice",
            "html_url": "https://github.example/acme/web/issues/42"}});
    let (status, receipt) = github(&app, &trigger, "issues", "d-1", &issue).await;
    assert_eq!(status, 202, "{receipt}");
    assert_eq!(receipt["duplicate"], false);
    assert_eq!(receipt["run"]["outcome"], "started_agent", "{receipt}");
    let agent = receipt["run"]["agent_id"].as_str().unwrap().to_owned();
    let workspace = receipt["run"]["workspace_id"].as_str().unwrap().to_owned();
    let first = user_message_with(&app, &agent, "Fix #42").await;
    assert_eq!(
        first,
        "Fix #42: Login crashes\nSteps: {{title}} twice\nhttps://github.example/acme/web/issues/42"
    );
    let shown = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(shown["labels"]["trigger"], id(&trigger), "{shown}");
    assert_eq!(
        shown["created_by"],
        ana.id.as_str(),
        "it acts as its creator"
    );

    // The same delivery again: acknowledged with the first run, nothing done twice.
    let (status, again) = github(&app, &trigger, "issues", "d-1", &issue).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["duplicate"], true);
    assert_eq!(again["run"]["id"], receipt["run"]["id"]);
    let opened = app
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    assert_eq!(opened["items"].as_array().unwrap().len(), 1, "{opened}");

    // A bad or missing signature: 401, nothing recorded or done.
    let bytes = serde_json::to_vec(&issue).unwrap();
    for sig in [
        Some(signature("not-the-secret", &bytes)),
        Some("sha256=zz".to_owned()),
        None,
    ] {
        let mut headers = vec![
            ("X-GitHub-Event", "issues".to_owned()),
            ("X-GitHub-Delivery", "d-forged".to_owned()),
        ];
        if let Some(s) = sig {
            headers.push(("X-Hub-Signature-256", s));
        }
        let (status, problem) = deliver(&app, &trigger, &headers, &bytes).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (401, Some("signature_invalid")),
            "{problem}"
        );
    }
    // A body that is not the signed one.
    let (status, _) = deliver(
        &app,
        &trigger,
        &[
            ("X-GitHub-Event", "issues".to_owned()),
            ("X-GitHub-Delivery", "d-forged".to_owned()),
            ("X-Hub-Signature-256", signature(&secret, b"{}")),
        ],
        &bytes,
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(runs(&ana, &trigger).await.len(), 1, "nothing recorded");

    // Another label, or another event: acknowledged and recorded as ignored, with why.
    let mut other = issue.clone();
    other["label"]["name"] = json!("bug");
    let (status, ignored) = github(&app, &trigger, "issues", "d-2", &other).await;
    assert_eq!(status, 202);
    assert_eq!(ignored["run"]["outcome"], "ignored", "{ignored}");
    assert!(
        ignored["run"]["reason"].as_str().unwrap().contains("bug"),
        "{ignored}"
    );

    // The agent's work becomes a pull request; a comment mentioning @agentry on it
    // reaches the agent.
    let number = open_pull_request(&app, &ana, &agent, &workspace).await;
    let comment = |text: &str, pr: i64| {
        json!({"action": "created", "issue": {"number": pr, "pull_request": {"url": "x"}},
            "comment": {"body": text}})
    };
    let (status, sent) = github(
        &app,
        &trigger,
        "issue_comment",
        "d-3",
        &comment("@agentry please also handle the empty password", number),
    )
    .await;
    assert_eq!(status, 202);
    assert_eq!(sent["run"]["outcome"], "sent_message", "{sent}");
    assert_eq!(sent["run"]["agent_id"], agent.as_str());
    user_message_with(&app, &agent, "handle the empty password").await;
    app.wait(&agent).await;

    // Without the mention, or on a pull request no agent opened: ignored.
    let (_, plain) = github(
        &app,
        &trigger,
        "issue_comment",
        "d-4",
        &comment("looks good", number),
    )
    .await;
    assert_eq!(plain["run"]["outcome"], "ignored", "{plain}");
    let (_, elsewhere) = github(
        &app,
        &trigger,
        "issue_comment",
        "d-5",
        &comment("@agentry hi", 999),
    )
    .await;
    assert_eq!(elsewhere["run"]["outcome"], "ignored", "{elsewhere}");
    assert!(
        elsewhere["run"]["reason"]
            .as_str()
            .unwrap()
            .contains("#999"),
        "{elsewhere}"
    );

    // While the agent runs a turn, the comment is queued and runs after it.
    app.prompt(&agent, "/sleep 3000").await;
    let (_, queued) = github(
        &app,
        &trigger,
        "issue_comment",
        "d-6",
        &comment("@agentry rename the helper too", number),
    )
    .await;
    assert_eq!(queued["run"]["outcome"], "queued", "{queued}");
    user_message_with(&app, &agent, "rename the helper too").await;
    app.wait(&agent).await;

    // A failed check on the pull request sends its name and the end of its output.
    let check = json!({"action": "completed", "check_run": {"name": "build",
        "conclusion": "failure", "pull_requests": [{"number": number}],
        "output": {"title": "1 error", "summary": "error[E0308]: mismatched types at src/login.rs:12"}}});
    let (_, failed) = github(&app, &trigger, "check_run", "d-7", &check).await;
    assert_eq!(failed["run"]["outcome"], "sent_message", "{failed}");
    let text = user_message_with(&app, &agent, "The check `build` failed").await;
    assert!(text.contains(&format!("pull request #{number}")), "{text}");
    assert!(text.contains("error[E0308]: mismatched types"), "{text}");
    app.wait(&agent).await;
    // A passing one is ignored.
    let mut passed = check.clone();
    passed["check_run"]["conclusion"] = json!("success");
    let (_, ok) = github(&app, &trigger, "check_run", "d-8", &passed).await;
    assert_eq!(ok["run"]["outcome"], "ignored");

    // A failed workflow run: its failed job's log is read from the forge (a redirect to
    // an address read without the token) and the part from its first error is sent.
    forge.set_workflow_jobs(
        555,
        json!([{"id": 801, "name": "lint", "conclusion": "success"},
               {"id": 802, "name": "unit tests", "conclusion": "failure"}]),
    );
    forge.set_job_log(
        802,
        &format!(
            "{}error[E0599]: no method named `hash` found for `Login`\n{}##[error]Process completed with exit code 101.\n",
            "2026-12-06T12:00:00Z Compiling crate\n".repeat(3000),
            "note: see the docs\n".repeat(5)
        ),
    );
    let workflow = json!({"action": "completed", "workflow_run": {"id": 555, "name": "tests",
        "conclusion": "failure", "pull_requests": [{"number": number}]}});
    let (_, failed) = github(&app, &trigger, "workflow_run", "d-9", &workflow).await;
    assert_eq!(failed["run"]["outcome"], "sent_message", "{failed}");
    let text = user_message_with(&app, &agent, "The check `tests` failed").await;
    assert!(text.contains("unit tests:"), "{text}");
    assert!(
        text.contains("error[E0599]: no method named `hash` found"),
        "{text}"
    );
    assert!(text.contains("exit code 101"), "{text}");
    assert!(
        text.len() < 12 * 1024,
        "the excerpt is capped: {} bytes",
        text.len()
    );
    app.wait(&agent).await;
    let calls = forge.calls();
    assert!(
        calls
            .iter()
            .any(|c| c.path.ends_with("/actions/runs/555/jobs") && c.status == 200),
        "{calls:?}"
    );
    let blob = calls
        .iter()
        .find(|c| c.path == "/_blobs/job-logs/802")
        .unwrap_or_else(|| panic!("the log was read: {calls:?}"));
    assert_eq!(
        (blob.status, blob.credential.as_deref()),
        (200, None),
        "the token goes to the API only"
    );

    // Runs are listed newest first, with what each did.
    let all = runs(&ana, &trigger).await;
    let outcomes: Vec<&str> = all.iter().map(|r| r["outcome"].as_str().unwrap()).collect();
    assert_eq!(
        outcomes,
        [
            "sent_message",
            "ignored",
            "sent_message",
            "queued",
            "ignored",
            "ignored",
            "sent_message",
            "ignored",
            "started_agent"
        ]
    );
    // Acting is audited as the creator, naming the trigger.
    let audit = ana
        .api
        .ok(
            Method::GET,
            "/v1/audit?action=trigger.run&limit=100",
            None,
            200,
        )
        .await;
    assert_eq!(audit["items"].as_array().unwrap().len(), 5, "{audit}");
    assert!(
        audit["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["actor"]["id"] == ana.id.as_str()),
        "{audit}"
    );

    // The secret is never shown again: not by a read, a list, the runs, the audit log or
    // a timeline, and not stored in the clear.
    let read = ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/triggers/{}", id(&trigger)),
            None,
            200,
        )
        .await;
    assert!(read.get("secret").is_none(), "{read}");
    let list = ana.api.ok(Method::GET, "/v1/triggers", None, 200).await;
    let all_audit = ana
        .api
        .ok(Method::GET, "/v1/audit?limit=200", None, 200)
        .await;
    let timeline = app.timeline(&agent).await;
    let everything = format!("{read}{list}{}{all_audit}{}", json!(all), json!(timeline));
    assert!(!everything.contains(&secret), "the secret was shown again");
    app.assert_database_lacks(&[&secret]).await;
    // The fake forge saw only the calls of the push and pull request.
    assert!(
        forge.calls().iter().all(|c| c.status < 400),
        "{:?}",
        forge.calls()
    );
}

/// An issue labelled `agentry`, numbered `number`.
fn labelled_issue(number: i64) -> Value {
    json!({"action": "labeled", "label": {"name": "agentry"},
        "issue": {"number": number, "title": "Slow remote", "body": "Fetch takes long",
            "html_url": format!("https://github.example/acme/web/issues/{number}")}})
}

async fn issue_trigger(who: &Person, project: &Value) -> Value {
    who.api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "web issues", "kind": "github", "project_id": project["id"],
                "provider": "mock"}),
            ),
            201,
        )
        .await
}

#[tokio::test]
async fn a_delivery_is_answered_before_its_slow_action_ends() {
    let (remote, _forge, app, ana, _team_a, project) = world(Flavor::GitHub).await;
    let trigger = issue_trigger(&ana, &project).await;
    // The remote holds every request: opening the agent fetches it first.
    remote.close();
    let (status, receipt) =
        github_answer(&app, &trigger, "issues", "slow-1", &labelled_issue(7)).await;
    assert_eq!(status, 202, "{receipt}");
    assert_eq!(receipt["run"]["state"], "pending", "{receipt}");
    assert!(receipt["run"]["outcome"].is_null(), "{receipt}");
    assert!(receipt["run"]["agent_id"].is_null(), "{receipt}");
    let run = receipt["run"]["id"].as_str().unwrap().to_owned();
    // The worker acts meanwhile: its fetch waits at the remote, the run says it runs.
    remote.request_waiting().await;
    let listed = runs(&ana, &trigger).await;
    assert_eq!(listed[0]["id"], run.as_str());
    assert_eq!(listed[0]["state"], "running", "{listed:?}");
    // A redelivery meanwhile is the same run, and does nothing more.
    let (status, again) =
        github_answer(&app, &trigger, "issues", "slow-1", &labelled_issue(7)).await;
    assert_eq!((status, again["duplicate"].as_bool()), (200, Some(true)));
    assert_eq!(again["run"]["id"], run.as_str());
    remote.open();
    let done = settled(&app, &trigger, &run).await;
    assert_eq!(
        (done["state"].as_str(), done["outcome"].as_str()),
        (Some("done"), Some("started_agent")),
        "{done}"
    );
    let opened = app
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    assert_eq!(opened["items"].as_array().unwrap().len(), 1, "{opened}");
    assert_eq!(runs(&ana, &trigger).await.len(), 1);
}

/// What is left of a server stopped while a delivery's run waited on the remote's fetch.
struct Stopped {
    remote: GitHttp,
    ana: Person,
    trigger: Value,
    run: String,
    db: sqlx::postgres::PgConnectOptions,
    dir: tempfile::TempDir,
    token: String,
}

/// A labelled-issue delivery (`delivery`, issue `number`) answered 202, its run held up by
/// the closed remote, then the only server stopped.
async fn stopped_while_a_run_fetches(delivery: &str, number: i64) -> Stopped {
    let (remote, _forge, app, ana, _team_a, project) = world(Flavor::GitHub).await;
    let trigger = issue_trigger(&ana, &project).await;
    remote.close();
    let (status, receipt) =
        github_answer(&app, &trigger, "issues", delivery, &labelled_issue(number)).await;
    assert_eq!(status, 202, "{receipt}");
    let run = receipt["run"]["id"].as_str().unwrap().to_owned();
    remote.request_waiting().await;
    let (db, dir, token) = app.stop().await;
    Stopped {
        remote,
        ana,
        trigger,
        run,
        db,
        dir,
        token,
    }
}

#[tokio::test]
async fn a_run_cut_short_by_a_shutdown_is_completed_by_the_next_start() {
    // The only replica stops while the run's fetch waits: the run is given back.
    let Stopped {
        remote,
        ana,
        trigger,
        run,
        db,
        dir,
        token,
    } = stopped_while_a_run_fetches("cut-1", 8).await;
    let pool = sqlx::PgPool::connect_with(db.clone()).await.unwrap();
    let (state, outcome, agents): (String, Option<String>, i64) =
        sqlx::query_as("SELECT state, outcome, (SELECT count(*) FROM agents) FROM trigger_runs")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    assert_eq!(
        (state.as_str(), outcome, agents),
        ("pending", None, 0),
        "left pending, nothing done"
    );
    remote.open();
    // The next start takes it and acts on it once.
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.projects.allow_private_remotes = true
    })
    .await;
    let done = settled(&app, &trigger, &run).await;
    assert_eq!(done["outcome"], "started_agent", "{done}");
    let opened = app
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    assert_eq!(opened["items"].as_array().unwrap().len(), 1, "{opened}");
    let agent = done["agent_id"].as_str().unwrap();
    user_message_with(&app, agent, "Slow remote").await;
    // The remote's credential is in none of what the run and its agent left.
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("git:{PASSWORD}"));
    let left = format!(
        "{}{}{}",
        json!(runs(&ana_on(&app, &ana), &trigger).await),
        json!(app.timeline(agent).await),
        app.get_ok(&format!("/v1/agents/{agent}")).await
    );
    assert!(
        !left.contains(PASSWORD) && !left.contains(&encoded),
        "{left}"
    );
    app.assert_database_lacks(&[PASSWORD, &encoded]).await;
}

/// `who` calling `app` (after a restart).
fn ana_on(app: &TestApp, who: &Person) -> Person {
    Person {
        id: who.id.clone(),
        api: Caller::new(app, &who.api.token),
    }
}

/// The state and checks of the pull request a workspace opened, as stored.
async fn stored_pull_request(app: &TestApp, number: i64) -> (String, Option<String>) {
    sqlx::query_as("SELECT pr_state, pr_checks FROM workspace_remotes WHERE pr_number = $1")
        .bind(number)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_pull_request_state_follows_deliveries_and_the_poll() {
    let (_remote, forge, app, ana, _team_a, project) =
        world_with(Flavor::GitHub, |s| s.triggers.pr_poll_s = 1).await;
    // No rule at all: the deliveries still tell the workspaces how their requests fare.
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "follow", "kind": "github", "project_id": project["id"],
                "provider": "mock",
                "rules": {"issue_labeled": null, "mention": null, "failed_check": null}}),
            ),
            201,
        )
        .await;
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(
                json!({"workspace": {"project_id": project["id"]}, "provider": "mock",
                "title": "Fix it"}),
            ),
            201,
        )
        .await;
    let workspace = agent["workspace_id"].as_str().unwrap().to_owned();
    let number = open_pull_request(&app, &ana, id(&agent), &workspace).await;
    assert_eq!(stored_pull_request(&app, number).await.0, "open");

    // The forge agrees with the deliveries, whenever the poll reads it meanwhile; the
    // run's reason tells what the delivery recorded.
    forge.set_check_runs(json!([{"status": "completed", "conclusion": "failure"}]));
    let suite = json!({"action": "completed", "check_suite": {"conclusion": "failure",
        "pull_requests": [{"number": number}]}});
    let (status, run) = github(&app, &trigger, "check_suite", "f-1", &suite).await;
    assert_eq!(status, 202);
    assert_eq!(run["run"]["outcome"], "ignored", "{run}");
    assert!(
        run["run"]["reason"]
            .as_str()
            .unwrap()
            .contains("checks failing"),
        "{run}"
    );
    assert_eq!(
        stored_pull_request(&app, number).await,
        ("open".to_owned(), Some("failing".to_owned()))
    );
    // Another request, or a redelivery, changes nothing.
    let mut other = suite.clone();
    other["check_suite"]["conclusion"] = json!("success");
    other["check_suite"]["pull_requests"] = json!([{"number": 999}]);
    github(&app, &trigger, "check_suite", "f-2", &other).await;
    let (status, _) = github(&app, &trigger, "check_suite", "f-1", &other).await;
    assert_eq!(status, 200);
    assert_eq!(
        stored_pull_request(&app, number).await.1.as_deref(),
        Some("failing")
    );

    // Closed without merging: the workspace says so.
    let closed = json!({"action": "closed", "pull_request": {"number": number, "merged": false}});
    github(&app, &trigger, "pull_request", "f-3", &closed).await;
    let ws = app.get_ok(&format!("/v1/workspaces/{workspace}")).await;
    assert_eq!(ws["opened_pull_request"]["state"], "closed", "{ws}");
    // Reopened, then merged on the forge with no delivery: the poll reads it.
    let reopened = json!({"action": "reopened", "pull_request": {"number": number}});
    github(&app, &trigger, "pull_request", "f-4", &reopened).await;
    assert_eq!(stored_pull_request(&app, number).await.0, "open");
    forge.merge(number);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while stored_pull_request(&app, number).await.0 != "merged" {
        assert!(
            std::time::Instant::now() < deadline,
            "the poll did not read the merge"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ws = app.get_ok(&format!("/v1/workspaces/{workspace}")).await;
    assert_eq!(ws["opened_pull_request"]["state"], "merged", "{ws}");
}

#[tokio::test]
async fn gitlab_deliveries_carry_the_token_and_a_failed_pipeline_sends_the_jobs_log() {
    let (_remote, forge, app, ana, _team_a, project) = world(Flavor::GitLab).await;
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "web mrs", "kind": "gitlab", "project_id": project["id"],
                "provider": "mock", "rules": {"mention": {"handle": "@bot"}}}),
            ),
            201,
        )
        .await;
    let labels = |titles: &[&str]| -> Value {
        Value::Array(titles.iter().map(|t| json!({"title": t})).collect())
    };
    let issue = json!({"object_kind": "issue", "object_attributes": {"iid": 5,
        "title": "Slow search", "description": "It takes 9 s", "url": "https://gitlab.example/group/web/-/issues/5"},
        "changes": {"labels": {"previous": labels(&["perf"]), "current": labels(&["perf", "agentry"])}}});
    let (status, receipt) = gitlab(&app, &trigger, "Issue Hook", "u-1", &issue).await;
    assert_eq!(status, 202, "{receipt}");
    assert_eq!(receipt["run"]["outcome"], "started_agent", "{receipt}");
    let agent = receipt["run"]["agent_id"].as_str().unwrap().to_owned();
    let workspace = receipt["run"]["workspace_id"].as_str().unwrap().to_owned();
    let first = user_message_with(&app, &agent, "Slow search").await;
    assert!(first.contains("It takes 9 s"), "{first}");
    assert!(first.contains("issues/5"), "{first}");
    // Redelivered (same event UUID): 200, the first run.
    let (status, again) = gitlab(&app, &trigger, "Issue Hook", "u-1", &issue).await;
    assert_eq!((status, again["duplicate"].as_bool()), (200, Some(true)));
    // A wrong or missing token: 401.
    for token in [Some("wrong"), None] {
        let mut headers = vec![("X-Gitlab-Event", "Issue Hook".to_owned())];
        if let Some(t) = token {
            headers.push(("X-Gitlab-Token", t.to_owned()));
        }
        let (status, problem) = deliver(
            &app,
            &trigger,
            &headers,
            &serde_json::to_vec(&issue).unwrap(),
        )
        .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (401, Some("signature_invalid")),
            "{problem}"
        );
    }

    let iid = open_pull_request(&app, &ana, &agent, &workspace).await;
    // A comment with the configured handle on the merge request.
    let note = json!({"object_kind": "note", "object_attributes": {"noteable_type": "MergeRequest",
        "note": "@bot use the index"}, "merge_request": {"iid": iid}});
    let (_, sent) = gitlab(&app, &trigger, "Note Hook", "u-2", &note).await;
    assert_eq!(sent["run"]["outcome"], "sent_message", "{sent}");
    user_message_with(&app, &agent, "@bot use the index").await;
    app.wait(&agent).await;

    // A failed pipeline: the failed job's log is read from the forge, its end sent.
    let log = format!(
        "{}\nthread 'search' panicked at src/index.rs:40\n",
        "setup ok\n".repeat(2000)
    );
    forge.set_job_trace(301, &log);
    let pipeline = json!({"object_kind": "pipeline", "object_attributes": {"id": 90, "status": "failed"},
        "merge_request": {"iid": iid},
        "builds": [{"id": 300, "name": "lint", "status": "success"},
                   {"id": 301, "name": "test", "status": "failed"}]});
    let (_, failed) = gitlab(&app, &trigger, "Pipeline Hook", "u-3", &pipeline).await;
    assert_eq!(failed["run"]["outcome"], "sent_message", "{failed}");
    let text = user_message_with(&app, &agent, "The check `test` failed").await;
    assert!(text.contains("panicked at src/index.rs:40"), "{text}");
    assert!(
        text.len() < 12 * 1024,
        "the excerpt is capped: {} bytes",
        text.len()
    );
    assert!(
        forge
            .calls()
            .iter()
            .any(|c| c.path.ends_with("/jobs/301/trace") && c.status == 200),
        "{:?}",
        forge.calls()
    );
    // The pipeline's status and the merge request's fate are recorded on the workspace.
    assert_eq!(
        stored_pull_request(&app, iid).await,
        ("open".to_owned(), Some("failing".to_owned()))
    );
    let merged = json!({"object_kind": "merge_request",
        "object_attributes": {"iid": iid, "action": "merge"}});
    let (_, run) = gitlab(&app, &trigger, "Merge Request Hook", "u-4", &merged).await;
    assert_eq!(run["run"]["outcome"], "ignored", "{run}");
    assert!(
        run["run"]["reason"]
            .as_str()
            .unwrap()
            .contains("state merged"),
        "{run}"
    );
    let ws = app.get_ok(&format!("/v1/workspaces/{workspace}")).await;
    assert_eq!(ws["opened_pull_request"]["state"], "merged", "{ws}");
    app.assert_database_lacks(&[trigger["secret"].as_str().unwrap()])
        .await;
}

#[tokio::test]
async fn triggers_belong_to_their_team_and_refuse_what_they_do_not_implement() {
    let (_remote, _forge, app, ana, team_a, project) = world(Flavor::GitHub).await;
    let bob = person(&app, "bob").await;
    let cem = person(&app, "cem").await;
    add(&ana, &team_a, &cem, "member").await;
    team(&bob, "beta").await;
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "t", "kind": "github", "project_id": project["id"], "provider": "mock"})),
            201,
        )
        .await;
    let path = format!("/v1/triggers/{}", id(&trigger));
    // Another team's trigger is missing, whatever is asked.
    for (method, p, body) in [
        (Method::GET, path.clone(), None),
        (Method::PATCH, path.clone(), Some(json!({"enabled": false}))),
        (Method::DELETE, path.clone(), None),
        (Method::GET, format!("{path}/runs"), None),
    ] {
        let (status, problem) = bob.api.call(method, &p, body).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (404, Some("not_found")),
            "{p}: {problem}"
        );
    }
    let listed = bob.api.ok(Method::GET, "/v1/triggers", None, 200).await;
    assert_eq!(listed["items"], json!([]));
    let (status, _) = bob
        .api
        .call(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "t", "kind": "github", "project_id": project["id"], "provider": "mock"})),
        )
        .await;
    assert_eq!(status, 404, "another team's project");
    // A member reads, but only owners create or change.
    let seen = cem.api.ok(Method::GET, &path, None, 200).await;
    assert!(seen.get("secret").is_none());
    cem.api
        .ok(Method::GET, &format!("{path}/runs"), None, 200)
        .await;
    let (status, _) = cem
        .api
        .call(Method::PATCH, &path, Some(json!({"enabled": false})))
        .await;
    assert_eq!(status, 403);
    let (status, _) = cem
        .api
        .call(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "t", "kind": "github", "project_id": project["id"], "provider": "mock"})),
        )
        .await;
    assert_eq!(status, 403);

    // What is not implemented is refused, with the field named.
    let base = json!({"name": "c", "kind": "cron", "project_id": project["id"], "provider": "mock",
        "schedule": "0 3 * * *", "prompt": "nightly"});
    for (change, field) in [
        (json!({"schedule": "0 3 * * MON"}), "schedule"),
        (json!({"schedule": "@daily"}), "schedule"),
        (json!({"schedule": "0 3 * *"}), "schedule"),
        (json!({"time_zone": "Mars/Olympus"}), "time_zone"),
        (json!({"rules": {}}), "rules"),
        (json!({"prompt": null}), "prompt"),
        (json!({"kind": "github"}), "schedule"),
        (
            json!({"kind": "github", "schedule": null, "prompt": null,
            "rules": {"mention": {"handle": "agentry"}}}),
            "rules.mention.handle",
        ),
    ] {
        let mut body = base.clone();
        for (k, v) in change.as_object().unwrap() {
            if v.is_null() {
                body.as_object_mut().unwrap().remove(k);
            } else {
                body[k] = v.clone();
            }
        }
        let (status, problem) = ana.api.call(Method::POST, "/v1/triggers", Some(body)).await;
        assert_eq!(
            (status, problem["errors"][0]["field"].as_str()),
            (422, Some(field)),
            "{change}: {problem}"
        );
    }
    for body in [
        json!({"name": "c", "kind": "cron", "project_id": project["id"], "provider": "mock",
            "schedule": "0 3 * * *", "prompt": "x", "color": "red"}),
        json!({"name": "c", "kind": "github", "project_id": project["id"], "provider": "mock",
            "rules": {"issue_labeled": {"labels": ["a"]}}}),
        json!({"name": "c", "kind": "svn", "project_id": project["id"], "provider": "mock"}),
        json!({"name": "c", "kind": "cron", "project_id": project["id"], "provider": "mock",
            "schedule": "0 3 * * *", "prompt": "x", "missed": "catch_up"}),
    ] {
        let (status, problem) = ana
            .api
            .call(Method::POST, "/v1/triggers", Some(body.clone()))
            .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (422, Some("validation_failed")),
            "{body}: {problem}"
        );
    }
    let (status, problem) = ana
        .api
        .call(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "c", "kind": "github", "project_id": project["id"], "provider": "nope"})),
        )
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (422, Some("unknown_provider"))
    );
    // A cron trigger in a time zone says when it runs next.
    let nightly = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(json!({"name": "nightly", "kind": "cron", "project_id": project["id"], "provider": "mock",
                "schedule": "0 3 * * *", "time_zone": "Europe/Berlin", "prompt": "tidy up"})),
            201,
        )
        .await;
    assert!(nightly.get("secret").is_none(), "{nightly}");
    assert_eq!(nightly["missed"], "run_once");
    let next: DateTime<Utc> = nightly["next_run_at"].as_str().unwrap().parse().unwrap();
    assert!(
        next > Utc::now() && next - Utc::now() <= chrono::Duration::hours(24),
        "{nightly}"
    );
    assert!(
        matches!(next.format("%H:%M").to_string().as_str(), "01:00" | "02:00"),
        "03:00 in Berlin: {next}"
    );
    // Changes are audited; deleting it makes its webhook missing.
    ana.api
        .ok(
            Method::PATCH,
            &path,
            Some(json!({"enabled": false, "name": "renamed"})),
            200,
        )
        .await;
    ana.api.ok(Method::DELETE, &path, None, 204).await;
    let (status, _) = github(&app, &trigger, "ping", "d-gone", &json!({})).await;
    assert_eq!(status, 404);
    let audit = ana
        .api
        .ok(Method::GET, "/v1/audit?limit=100", None, 200)
        .await;
    let actions: Vec<&str> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .filter(|a| a.starts_with("trigger."))
        .collect();
    assert_eq!(
        actions,
        [
            "trigger.delete",
            "trigger.update",
            "trigger.create",
            "trigger.create"
        ]
    );
}

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

/// A team owned by ana with a local repository project, on `app`.
async fn cron_world(app: &TestApp, repo: &std::path::Path) -> (Person, Value) {
    let ana = person(app, "ana").await;
    let team_a = team(&ana, "alpha").await;
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": "demo", "repo_path": repo, "team_id": team_a}),
            201,
        )
        .await;
    (ana, project)
}

async fn cron_runs(ana: &Person, trigger: &Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = runs(ana, trigger)
        .await
        .iter()
        .map(|r| {
            (
                r["slot"].as_str().unwrap().to_owned(),
                r["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    out.reverse();
    out
}

#[tokio::test]
async fn a_cron_trigger_runs_once_per_slot_with_two_replicas() {
    let start = at("2030-01-01T12:00:30Z");
    let one = spawn_app_with(|s| s.triggers.manual_clock_start = Some(start)).await;
    let two = spawn_on_with(
        one.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(one.token.clone()),
        |s| s.triggers.manual_clock_start = Some(start),
    )
    .await;
    let repo = git_repo();
    let (ana, project) = cron_world(&one, repo.path()).await;
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "every minute", "kind": "cron", "project_id": project["id"],
                "provider": "mock", "schedule": "* * * * *", "prompt": "check the queue"}),
            ),
            201,
        )
        .await;
    assert_eq!(trigger["next_run_at"], "2030-01-01T12:01:00Z", "{trigger}");
    // Both replicas see each minute pass; each slot runs once.
    for minute in ["12:01:02", "12:02:01", "12:03:05"] {
        let now = at(&format!("2030-01-01T{minute}Z"));
        one.triggers.set_clock(now);
        two.triggers.set_clock(now);
        one.triggers.handled_through(now).await;
        two.triggers.handled_through(now).await;
    }
    // Looking again at the same time runs nothing more.
    let now = at("2030-01-01T12:03:30Z");
    two.triggers.set_clock(now);
    one.triggers.set_clock(now);
    one.triggers.handled_through(now).await;
    two.triggers.handled_through(now).await;
    assert_eq!(
        cron_runs(&ana, &trigger).await,
        [
            (
                "2030-01-01T12:01:00Z".to_owned(),
                "started_agent".to_owned()
            ),
            (
                "2030-01-01T12:02:00Z".to_owned(),
                "started_agent".to_owned()
            ),
            (
                "2030-01-01T12:03:00Z".to_owned(),
                "started_agent".to_owned()
            ),
        ]
    );
    let agents = one
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    let agents = agents["items"].as_array().unwrap();
    assert_eq!(agents.len(), 3);
    let first = agents[0]["id"].as_str().unwrap();
    user_message_with(&one, first, "check the queue").await;
    two.stop().await;
}

#[tokio::test]
async fn a_slot_missed_while_no_replica_ran_runs_once_at_start_or_is_skipped() {
    let start = at("2030-01-01T12:00:30Z");
    let app = spawn_app_with(|s| s.triggers.manual_clock_start = Some(start)).await;
    let repo = git_repo();
    let (ana, project) = cron_world(&app, repo.path()).await;
    let mut triggers = Vec::new();
    for missed in ["run_once", "skip"] {
        triggers.push(
            ana.api
                .ok(
                    Method::POST,
                    "/v1/triggers",
                    Some(
                        json!({"name": missed, "kind": "cron", "project_id": project["id"],
                        "provider": "mock", "schedule": "0 * * * *", "prompt": "hourly chores",
                        "missed": missed}),
                    ),
                    201,
                )
                .await,
        );
    }
    // Every replica stops; three hourly slots pass; one starts at 15:20.
    let (db, dir, token) = app.stop().await;
    let later = at("2030-01-01T15:20:00Z");
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.triggers.manual_clock_start = Some(later)
    })
    .await;
    let ana = Person {
        id: ana.id.clone(),
        api: Caller::new(&app, &ana.api.token),
    };
    app.triggers.handled_through(later).await;
    let run_once = cron_runs(&ana, &triggers[0]).await;
    assert_eq!(
        run_once,
        [(
            "2030-01-01T15:00:00Z".to_owned(),
            "started_agent".to_owned()
        )],
        "run once for the missed slots"
    );
    let reason = runs(&ana, &triggers[0]).await[0]["reason"].clone();
    assert!(reason.as_str().unwrap().contains("missed"), "{reason}");
    assert_eq!(
        cron_runs(&ana, &triggers[1]).await,
        [("2030-01-01T15:00:00Z".to_owned(), "ignored".to_owned())],
        "skipped"
    );
    // The next slot on time runs for both.
    let next = at("2030-01-01T16:00:02Z");
    app.triggers.set_clock(next);
    app.triggers.handled_through(next).await;
    assert_eq!(cron_runs(&ana, &triggers[1]).await.len(), 2);
    assert_eq!(
        cron_runs(&ana, &triggers[1]).await[1],
        (
            "2030-01-01T16:00:00Z".to_owned(),
            "started_agent".to_owned()
        )
    );
    assert_eq!(cron_runs(&ana, &triggers[0]).await.len(), 2);
}

#[tokio::test]
async fn two_replicas_act_on_each_delivery_once() {
    // Replicas share the key that seals the trigger's secret.
    let one = spawn_app_with(|s| crate::secrets::with_keys(s, 7, &[])).await;
    let two = spawn_on_with(
        one.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(one.token.clone()),
        |s| crate::secrets::with_keys(s, 7, &[]),
    )
    .await;
    let repo = git_repo();
    let (ana, project) = cron_world(&one, repo.path()).await;
    let trigger = issue_trigger(&ana, &project).await;
    // Deliveries reach either replica; both workers look for pending runs.
    let mut runs_made = Vec::new();
    for n in 0..6_i64 {
        let app = if n % 2 == 0 { &one } else { &two };
        let (status, answer) = github_answer(
            app,
            &trigger,
            "issues",
            &format!("r-{n}"),
            &labelled_issue(100 + n),
        )
        .await;
        assert_eq!(status, 202, "{answer}");
        runs_made.push(answer["run"]["id"].as_str().unwrap().to_owned());
    }
    let mut agents = std::collections::BTreeSet::new();
    for run in &runs_made {
        let done = settled(&one, &trigger, run).await;
        assert_eq!(done["outcome"], "started_agent", "{done}");
        agents.insert(done["agent_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(agents.len(), 6, "one agent per run");
    let opened = one
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    assert_eq!(opened["items"].as_array().unwrap().len(), 6, "{opened}");
    two.stop().await;
}

#[tokio::test]
async fn a_run_held_by_a_replica_that_died_is_taken_once_its_lease_lapses() {
    let Stopped {
        remote,
        trigger,
        run,
        db,
        dir,
        token,
        ..
    } = stopped_while_a_run_fetches("died-1", 9).await;
    // As if another replica had taken the run and died without a word: it holds the
    // run for a few seconds more, and never renews.
    let pool = sqlx::PgPool::connect_with(db.clone()).await.unwrap();
    let (held, lapses): (i32, DateTime<Utc>) = sqlx::query_as(
        "UPDATE trigger_runs SET state = 'running', attempt = attempt + 1,
                lease_until = now() + interval '5 seconds'
         WHERE state = 'pending' RETURNING attempt, lease_until",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    remote.open();
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.projects.allow_private_remotes = true;
        s.triggers.run_lease_s = 3;
    })
    .await;
    let done = settled(&app, &trigger, &run).await;
    assert_eq!(done["outcome"], "started_agent", "{done}");
    let (attempt, after): (i32, bool) =
        sqlx::query_as("SELECT attempt, now() >= $1 FROM trigger_runs")
            .bind(lapses)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(after, "taken only once the lease lapsed");
    pool.close().await;
    assert_eq!(
        attempt,
        held + 1,
        "taken once, after the dead replica's attempt"
    );
    let opened = app
        .get_ok(&format!("/v1/agents?label=trigger:{}", id(&trigger)))
        .await;
    assert_eq!(opened["items"].as_array().unwrap().len(), 1, "{opened}");
}

#[tokio::test]
async fn rotating_the_secrets_key_moves_trigger_secrets_and_deliveries_still_verify() {
    use crate::secrets::{rotate, with_keys};
    let (_remote, _forge, app, ana, _team_a, project) =
        world_with(Flavor::GitHub, |s| with_keys(s, 1, &[])).await;
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "rotated", "kind": "github", "project_id": project["id"],
                "provider": "mock", "rules": {"issue_labeled": {"prompt": "Fix #{{number}}"}}}),
            ),
            201,
        )
        .await;
    let secret = trigger["secret"].as_str().unwrap().to_owned();
    let (db, dir, token) = app.stop().await;
    let (ok, out) = rotate(&db, dir.path(), 2, &[1]);
    assert!(ok && out.contains("trigger secrets: 1 moved"), "{out}");
    assert!(!out.contains(&secret), "{out}");
    let (ok, out) = rotate(&db, dir.path(), 2, &[]);
    assert!(
        ok && out.contains("trigger secrets: 0 moved") && out.contains(", 0 failed"),
        "a second run has nothing to do, and needs no previous key: {out}"
    );

    // Under the new key alone, a delivery signed with the same secret is verified (an
    // event no rule takes: acknowledged and recorded as ignored), a forged one is not.
    let app = spawn_on_with(db, dir, Some(token), |s| {
        s.projects.allow_private_remotes = true;
        with_keys(s, 2, &[]);
    })
    .await;
    let other = json!({"action": "labeled", "label": {"name": "bug"},
        "issue": {"number": 7, "title": "t", "body": "", "html_url": "https://x/7"}});
    let (status, receipt) = github(&app, &trigger, "issues", "r-1", &other).await;
    assert_eq!(status, 202, "{receipt}");
    assert_eq!(receipt["run"]["outcome"], "ignored", "{receipt}");
    let mut forged = trigger.clone();
    forged["secret"] = json!("not-the-secret");
    let (status, _) = github(&app, &forged, "issues", "r-2", &other).await;
    assert_eq!(status, 401);
}
