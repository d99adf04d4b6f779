//! Teams and members in local mode, the last-owner rule, team service tokens, and the
//! audit log.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

#[tokio::test]
async fn a_local_team_of_several_people_works_end_to_end() {
    let app = spawn_app().await;
    let admin = Caller::new(&app, &app.token);
    let ana = person(&app, "ana").await;
    let bo = person(&app, "bo").await;
    let team_id = team(&ana, "platform").await;

    // Names are unique.
    bo.api
        .refused(
            Method::POST,
            "/v1/teams",
            Some(json!({"name": "platform"})),
            409,
            "team_name_taken",
        )
        .await;
    // Ana finds Bo by exact email and adds him (201), then changes his role (200).
    let found = ana
        .api
        .ok(Method::GET, "/v1/users?email=BO@example.com", None, 200)
        .await;
    assert_eq!(found["items"].as_array().unwrap().len(), 1);
    assert_eq!(found["items"][0]["id"], bo.id.as_str());
    let members = format!("/v1/teams/{team_id}/members");
    let added = ana
        .api
        .ok(
            Method::PUT,
            &format!("{members}/{}", bo.id),
            Some(json!({"role": "member"})),
            201,
        )
        .await;
    assert_eq!(added["role"], "member");
    assert_eq!(added["email"], "bo@example.com");
    let changed = ana
        .api
        .ok(
            Method::PUT,
            &format!("{members}/{}", bo.id),
            Some(json!({"role": "viewer"})),
            200,
        )
        .await;
    assert_eq!(changed["role"], "viewer");

    // Bo sees the team with his role, and its members.
    let teams = bo.api.ok(Method::GET, "/v1/teams", None, 200).await;
    assert_eq!(teams["items"].as_array().unwrap().len(), 1);
    assert_eq!(teams["items"][0]["role"], "viewer");
    let me = bo.api.ok(Method::GET, "/v1/me", None, 200).await;
    assert_eq!(me["teams"][0]["id"], team_id.as_str());
    let detail = bo
        .api
        .ok(Method::GET, &format!("/v1/teams/{team_id}"), None, 200)
        .await;
    assert_eq!(detail["members"].as_array().unwrap().len(), 2);
    assert_eq!(detail["more_members"], false);
    let page = bo
        .api
        .ok(Method::GET, &format!("{members}?limit=1"), None, 200)
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    let cursor = page["next_cursor"].as_str().expect("a second page");
    let page2 = bo
        .api
        .ok(
            Method::GET,
            &format!("{members}?limit=1&cursor={cursor}"),
            None,
            200,
        )
        .await;
    assert_eq!(page2["items"].as_array().unwrap().len(), 1);
    assert_ne!(page["items"][0]["user_id"], page2["items"][0]["user_id"]);
    assert!(page2["next_cursor"].is_null());

    // A viewer changes nothing in the team; nor does a stranger look users up.
    bo.api
        .refused(
            Method::PUT,
            &format!("{members}/{}", ana.id),
            Some(json!({"role": "viewer"})),
            403,
            "forbidden",
        )
        .await;
    bo.api
        .refused(
            Method::DELETE,
            &format!("{members}/{}", ana.id),
            None,
            403,
            "forbidden",
        )
        .await;
    bo.api
        .refused(
            Method::GET,
            "/v1/users?email=ana@example.com",
            None,
            403,
            "forbidden",
        )
        .await;
    bo.api
        .refused(
            Method::POST,
            "/v1/users",
            Some(json!({"email": "eve@example.com", "name": "Eve"})),
            403,
            "forbidden",
        )
        .await;
    // Owners look people up by exact email only; admins list everyone.
    ana.api
        .refused(Method::GET, "/v1/users", None, 403, "forbidden")
        .await;
    let all = admin.ok(Method::GET, "/v1/users", None, 200).await;
    assert_eq!(all["items"].as_array().unwrap().len(), 3, "{all}");
    admin
        .refused(
            Method::POST,
            "/v1/users",
            Some(json!({"email": "ana@example.com", "name": "Ana again"})),
            409,
            "user_email_taken",
        )
        .await;
    admin
        .refused(
            Method::POST,
            "/v1/users",
            Some(json!({"email": "not an email", "name": "X"})),
            422,
            "validation_failed",
        )
        .await;

    // The last owner can be neither demoted nor removed, not even by an admin.
    ana.api
        .refused(
            Method::PUT,
            &format!("{members}/{}", ana.id),
            Some(json!({"role": "member"})),
            409,
            "last_owner",
        )
        .await;
    admin
        .refused(
            Method::DELETE,
            &format!("{members}/{}", ana.id),
            None,
            409,
            "last_owner",
        )
        .await;
    // With a second owner, the first may step down.
    ana.api
        .ok(
            Method::PUT,
            &format!("{members}/{}", bo.id),
            Some(json!({"role": "owner"})),
            200,
        )
        .await;
    ana.api
        .ok(
            Method::PUT,
            &format!("{members}/{}", ana.id),
            Some(json!({"role": "member"})),
            200,
        )
        .await;
    bo.api
        .refused(
            Method::DELETE,
            &format!("{members}/{}", bo.id),
            None,
            409,
            "last_owner",
        )
        .await;
    // A member may leave; then the team is gone for them, on their next request.
    ana.api
        .ok(Method::DELETE, &format!("{members}/{}", ana.id), None, 204)
        .await;
    ana.api
        .refused(
            Method::GET,
            &format!("/v1/teams/{team_id}"),
            None,
            404,
            "not_found",
        )
        .await;
    let teams = ana.api.ok(Method::GET, "/v1/teams", None, 200).await;
    assert!(teams["items"].as_array().unwrap().is_empty());
    // Removing someone who is not a member, or a user who does not exist: 404.
    bo.api
        .refused(
            Method::DELETE,
            &format!("{members}/{}", ana.id),
            None,
            404,
            "not_found",
        )
        .await;
    let nobody = agentry::domain::UserId::from(uuid::Uuid::now_v7());
    bo.api
        .refused(
            Method::PUT,
            &format!("{members}/{nobody}"),
            Some(json!({"role": "member"})),
            404,
            "not_found",
        )
        .await;
    // The admin sees every team.
    let teams = admin.ok(Method::GET, "/v1/teams", None, 200).await;
    let names: Vec<&str> = teams["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{teams}");
    assert!(names.contains(&"platform") && names.contains(&"default"));
}

#[tokio::test]
async fn team_service_tokens_act_only_in_their_team_and_revocation_is_immediate() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let cleo = person(&app, "cleo").await;
    let team_id = team(&ana, "platform").await;
    let other = team(&cleo, "elsewhere").await;
    add(&ana, &team_id, &cleo, "owner").await;
    let repo = git_repo();
    // Registering a local repository is a server admin's part.
    let project = Caller::new(&app, &app.token)
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "web", "team_id": team_id, "repo_path": repo.path()})),
            201,
        )
        .await;
    let created = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "ci", "team_id": team_id, "role": "member", "scopes": ["agents"]})),
            201,
        )
        .await;
    let ci = Caller::new(&app, created["token"].as_str().unwrap());
    // It drives agents in its team...
    let ws = ci
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    // ...but is a member there, not more, and cannot create teams or see other teams.
    ci.refused(
        Method::POST,
        "/v1/teams",
        Some(json!({"name": "bots"})),
        403,
        "insufficient_scope",
    )
    .await;
    let teams = ci.ok(Method::GET, "/v1/teams", None, 200).await;
    assert_eq!(teams["items"].as_array().unwrap().len(), 1);
    assert_eq!(teams["items"][0]["role"], "member");
    ci.refused(
        Method::GET,
        &format!("/v1/teams/{other}"),
        None,
        404,
        "not_found",
    )
    .await;
    // A member-role service token makes no tokens (not even by leaving `team_id` out),
    // sees only its team's tokens and cannot revoke its maker's personal ones.
    let full = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "ci-full", "team_id": team_id})),
            201,
        )
        .await;
    let full = Caller::new(&app, full["token"].as_str().unwrap());
    full.refused(
        Method::POST,
        "/v1/tokens",
        Some(json!({"name": "escalate"})),
        403,
        "forbidden",
    )
    .await;
    let names = |list: &Value| -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let mine = ana.api.ok(Method::GET, "/v1/tokens", None, 200).await;
    assert_eq!(names(&mine), ["ana's laptop", "ci", "ci-full"]);
    let seen = full.ok(Method::GET, "/v1/tokens", None, 200).await;
    assert_eq!(names(&seen), ["ci", "ci-full"]);
    let laptop = mine["items"][0]["id"].as_str().unwrap();
    full.refused(
        Method::DELETE,
        &format!("/v1/tokens/{laptop}"),
        None,
        404,
        "not_found",
    )
    .await;
    // The team's bots are listed for its members, whoever made them; not for outsiders.
    let of_team = cleo
        .api
        .ok(
            Method::GET,
            &format!("/v1/tokens?team_id={team_id}"),
            None,
            200,
        )
        .await;
    assert_eq!(names(&of_team), ["ci", "ci-full"]);
    assert!(
        of_team["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.get("token").is_none() && t["team_id"] == team_id.as_str()),
        "{of_team}"
    );
    let outsider = person(&app, "olaf").await;
    outsider
        .api
        .refused(
            Method::GET,
            &format!("/v1/tokens?team_id={team_id}"),
            None,
            404,
            "not_found",
        )
        .await;
    // Another owner of the team revokes it; its next request is refused.
    cleo.api
        .ok(
            Method::DELETE,
            &format!("/v1/tokens/{}", created["id"].as_str().unwrap()),
            None,
            204,
        )
        .await;
    let (status, body, request_id) = ci
        .call_full(
            Method::GET,
            &format!("/v1/workspaces/{}", ws["id"].as_str().unwrap()),
            None,
            Some("after-revoke"),
        )
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("token_revoked"))
    );
    assert_eq!(
        request_id, "after-revoke",
        "refusals carry the request id too"
    );
}

#[tokio::test]
async fn an_action_that_cannot_be_audited_is_not_reported_as_done() {
    let app = spawn_app().await;
    let admin = Caller::new(&app, &app.token);
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    // From now on the audit log refuses every entry.
    sqlx::query(
        "CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql
         AS $$ BEGIN RAISE EXCEPTION 'the audit log is refusing writes'; END $$",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_audit BEFORE INSERT ON audit_log
         FOR EACH ROW EXECUTE FUNCTION refuse_audit()",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    // An action that is one write shares its entry's transaction: nothing is left of it.
    let other = git_repo();
    admin
        .refused(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "second", "repo_path": other.path()})),
            500,
            "internal",
        )
        .await;
    let projects = admin.ok(Method::GET, "/v1/projects", None, 200).await;
    assert_eq!(projects["items"].as_array().unwrap().len(), 1, "{projects}");
    admin
        .refused(
            Method::POST,
            "/v1/teams",
            Some(json!({"name": "unaudited"})),
            500,
            "internal",
        )
        .await;
    let teams = admin.ok(Method::GET, "/v1/teams", None, 200).await;
    assert_eq!(teams["items"].as_array().unwrap().len(), 1, "{teams}");
    // An action done before its entry is written is answered as a failure, not as done.
    admin
        .refused(
            Method::POST,
            &format!("/v1/agents/{agent}/interrupt"),
            None,
            500,
            "internal",
        )
        .await;
}

/// The audit entries of `team`, newest first, read by `who` page by page.
async fn audit_of(who: &Caller, query: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut path = format!("/v1/audit?{query}&limit=3");
    loop {
        let page = who.ok(Method::GET, &path, None, 200).await;
        out.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => path = format!("/v1/audit?{query}&limit=3&cursor={c}"),
            None => return out,
        }
    }
}

#[tokio::test]
async fn the_audit_log_records_who_did_what_for_which_request() {
    // Ana's team may register repositories under the root that holds `repo`.
    let repo = git_repo();
    let root = repo.path().to_path_buf();
    let app = spawn_app_with(move |s| {
        s.projects.local_roots = vec![agentry::config::LocalRoot {
            path: root,
            teams: vec!["platform".into()],
        }]
    })
    .await;
    let admin = Caller::new(&app, &app.token);
    let ana = person(&app, "ana").await;
    let bo = person(&app, "bo").await;
    let team_id = team(&ana, "platform").await;
    add(&ana, &team_id, &bo, "member").await;
    let project = ana
        .api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "web", "team_id": team_id, "repo_path": repo.path()})),
            201,
        )
        .await;
    let project_id = project["id"].as_str().unwrap();
    // Bo works: a workspace, an agent that asks, his answer, an interrupt, an archive.
    let (status, ws, rid) = bo
        .api
        .call_full(
            Method::POST,
            "/v1/workspaces",
            Some(&json!({"project_id": project_id})),
            Some("ci-run-42"),
        )
        .await;
    assert_eq!((status, rid.as_str()), (201, "ci-run-42"), "{ws}");
    let ws_id = ws["id"].as_str().unwrap();
    let agent = bo
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws_id, "provider": "mock"})),
            201,
        )
        .await;
    let agent_id = agent["id"].as_str().unwrap();
    bo.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent_id}/messages"),
            Some(json!({"text": "/ask deploy?"})),
            202,
        )
        .await;
    let mut request_id = None;
    for _ in 0..300 {
        let p = bo
            .api
            .ok(
                Method::GET,
                &format!("/v1/agents/{agent_id}/permissions?status=pending"),
                None,
                200,
            )
            .await;
        if let Some(r) = p["items"][0]["request_id"].as_str() {
            request_id = Some(r.to_owned());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let request_id = request_id.expect("the agent asked");
    bo.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent_id}/permissions/{request_id}"),
            Some(json!({"behavior": "deny", "message": "not today"})),
            200,
        )
        .await;
    bo.api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent_id}/interrupt"),
            None,
            202,
        )
        .await;
    bo.api
        .ok(Method::DELETE, &format!("/v1/agents/{agent_id}"), None, 204)
        .await;
    bo.api
        .ok(
            Method::POST,
            &format!("/v1/workspaces/{ws_id}/archive"),
            None,
            200,
        )
        .await;
    // Ana manages: a service token made and revoked, Bo's role, the project deleted.
    let token = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "ci", "team_id": team_id})),
            201,
        )
        .await;
    let secret = token["token"].as_str().unwrap().to_owned();
    let token_id = token["id"].as_str().unwrap();
    ana.api
        .ok(Method::DELETE, &format!("/v1/tokens/{token_id}"), None, 204)
        .await;
    ana.api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team_id}/members/{}", bo.id),
            Some(json!({"role": "viewer"})),
            200,
        )
        .await;
    ana.api
        .ok(
            Method::DELETE,
            &format!("/v1/projects/{project_id}"),
            None,
            204,
        )
        .await;
    ana.api
        .ok(
            Method::DELETE,
            &format!("/v1/teams/{team_id}/members/{}", bo.id),
            None,
            204,
        )
        .await;

    let entries = audit_of(&ana.api, &format!("team_id={team_id}")).await;
    let actions: Vec<&str> = entries
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "member.remove",
            "project.delete",
            "member.role",
            "token.revoke",
            "token.create",
            "workspace.archive",
            "agent.archive",
            "agent.interrupt",
            "permission.answer",
            "agent.prompt",
            "agent.create",
            "workspace.create",
            "project.create",
            "member.add",
            "team.create",
        ],
        "newest first"
    );
    let by = |action: &str| entries.iter().find(|e| e["action"] == action).unwrap();
    let created = by("workspace.create");
    assert_eq!(
        created["actor"],
        json!({"kind": "user", "id": bo.id, "email": "bo@example.com"})
    );
    assert_eq!(created["team_id"], team_id.as_str());
    assert_eq!(created["target"], json!({"kind": "workspace", "id": ws_id}));
    assert_eq!(created["request_id"], "ci-run-42");
    let answer = by("permission.answer");
    assert_eq!(answer["target"]["id"], request_id.as_str());
    assert_eq!(answer["details"]["behavior"], "deny");
    assert_eq!(answer["details"]["agent_id"], agent_id);
    assert_eq!(by("member.role")["details"]["role"], "viewer");
    assert_eq!(by("member.role")["details"]["previous_role"], "member");
    assert_eq!(by("agent.create")["details"]["provider"], "mock");
    for e in &entries {
        assert!(e["id"].as_str().unwrap().starts_with("aud_"));
        assert!(
            e["request_id"].as_str().is_some_and(|r| !r.is_empty()),
            "{e}"
        );
        assert!(!e.to_string().contains(&secret), "a token value in {e}");
    }

    // Filters: by action, by actor.
    let prompts = audit_of(&ana.api, &format!("team_id={team_id}&action=agent.prompt")).await;
    assert_eq!(prompts.len(), 1);
    let bos = audit_of(&ana.api, &format!("team_id={team_id}&actor_id={}", bo.id)).await;
    assert_eq!(bos.len(), 7, "{bos:?}");
    ana.api
        .refused(
            Method::GET,
            "/v1/audit?action=agent.explode",
            None,
            422,
            "validation_failed",
        )
        .await;
    // Owners read their teams' entries without naming the team; others are refused; an
    // unknown team is missing.
    assert_eq!(audit_of(&ana.api, "").await.len(), entries.len());
    bo.api
        .refused(Method::GET, "/v1/audit", None, 403, "forbidden")
        .await;
    let other = team(&bo, "bo's own").await;
    ana.api
        .refused(
            Method::GET,
            &format!("/v1/audit?team_id={other}"),
            None,
            404,
            "not_found",
        )
        .await;
    // The admin reads everything, also what happened in no team, and is named as admin.
    let all = audit_of(&admin, "").await;
    let user_create = all
        .iter()
        .find(|e| e["action"] == "user.create" && e["target"]["id"] == ana.id.as_str())
        .expect("the admin's user.create");
    assert_eq!(user_create["actor"]["kind"], "admin");
    assert!(user_create["team_id"].is_null());
    assert!(
        all.iter()
            .any(|e| e["action"] == "team.create" && e["team_id"] == other.as_str())
    );
    // A service token is named by its token id.
    let svc = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "svc", "team_id": team_id, "role": "owner"})),
            201,
        )
        .await;
    let svc_api = Caller::new(&app, svc["token"].as_str().unwrap());
    svc_api
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "api", "repo_path": repo.path()})),
            201,
        )
        .await;
    let latest = audit_of(
        &ana.api,
        &format!("team_id={team_id}&action=project.create"),
    )
    .await;
    assert_eq!(
        latest[0]["actor"],
        json!({"kind": "service_token", "id": svc["id"]})
    );
}

#[tokio::test]
async fn two_owners_demoting_each_other_at_once_leave_one_owner() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let bo = person(&app, "bo").await;
    for round in 0..5 {
        let team_id = team(&ana, &format!("race {round}")).await;
        add(&ana, &team_id, &bo, "owner").await;
        let demote = |who: &Person, whom: &Person| {
            let api = who.api.clone();
            let path = format!("/v1/teams/{team_id}/members/{}", whom.id);
            async move {
                api.call(Method::PUT, &path, Some(json!({"role": "member"})))
                    .await
            }
        };
        let (a, b) = tokio::join!(demote(&ana, &bo), demote(&bo, &ana));
        // One demotion wins. The other is refused: as `last_owner` when both were let in
        // as owners, or as `forbidden` when the winner committed before the loser's
        // request was authenticated (its caller is then no owner any more). Never both.
        let (won, lost) = if a.0 == 200 { (&a, &b) } else { (&b, &a) };
        assert_eq!(won.0, 200, "round {round}: {a:?} {b:?}");
        let refused = (lost.0, lost.1["code"].as_str().unwrap_or_default());
        assert!(
            refused == (409, "last_owner") || refused == (403, "forbidden"),
            "round {round}: {a:?} {b:?}"
        );
        let members = ana
            .api
            .ok(
                Method::GET,
                &format!("/v1/teams/{team_id}/members"),
                None,
                200,
            )
            .await;
        let owners = members["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "owner")
            .count();
        assert_eq!(owners, 1, "round {round}: {members}");
    }
}
