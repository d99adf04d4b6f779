//! Who may call which route, in one table: every `/v1` route is declared here with the
//! `Operation` it performs (`auth::policy` says which token scope and team role each
//! needs). The `enforce` middleware authenticates every request to a declared route and
//! checks the token's scope before the handler runs; the handler's service then checks
//! the role in the team of the resource it loads. A handler whose route is missing here
//! cannot serve a request at all (its `Principal` extractor refuses), and a test walks
//! the OpenAPI document so that a new route cannot be forgotten.

use std::collections::HashSet;
use std::sync::OnceLock;

use actix_web::HttpMessage;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;

use super::auth::authenticate_request;
use super::error::ApiError;
use crate::auth::Operation;

/// Every `/v1` route: method, path template (as in the OpenAPI document) and operation.
pub const ROUTES: &[(&str, &str, Operation)] = {
    use Operation::*;
    &[
        ("GET", "/v1/me", ReadSelf),
        ("PUT", "/v1/me/default-team", ManageSelf),
        ("GET", "/v1/tokens", ReadSelf),
        ("POST", "/v1/tokens", ManageSelf),
        ("DELETE", "/v1/tokens/{id}", ManageSelf),
        ("GET", "/v1/auth/device", ReadSelf),
        ("POST", "/v1/auth/device/approve", ManageSelf),
        ("POST", "/v1/auth/device/deny", ManageSelf),
        ("POST", "/v1/teams", ManageSelf),
        ("GET", "/v1/teams", ReadSelf),
        ("GET", "/v1/teams/{id}", ReadTeam),
        ("GET", "/v1/teams/{id}/members", ReadTeam),
        ("PUT", "/v1/teams/{id}/members/{user_id}", ManageTeam),
        ("DELETE", "/v1/teams/{id}/members/{user_id}", ManageTeam),
        ("POST", "/v1/users", AdministerServer),
        ("GET", "/v1/users", FindUsers),
        ("POST", "/v1/users/{id}/tokens", AdministerServer),
        ("GET", "/v1/audit", ReadAsOwner),
        ("GET", "/v1/projects", ReadTeam),
        ("POST", "/v1/projects", ManageTeam),
        ("GET", "/v1/projects/{id}", ReadTeam),
        ("DELETE", "/v1/projects/{id}", ManageTeam),
        ("GET", "/v1/workspaces", ReadTeam),
        ("POST", "/v1/workspaces", DriveAgents),
        ("GET", "/v1/workspaces/{id}", ReadTeam),
        ("GET", "/v1/workspaces/{id}/diff", ReadTeam),
        ("POST", "/v1/workspaces/{id}/archive", DriveAgents),
        ("POST", "/v1/workspaces/{id}/push", DriveAgents),
        ("POST", "/v1/workspaces/{id}/pull-request", DriveAgents),
        ("GET", "/v1/cluster", ReadSelf),
        ("GET", "/v1/agents", ReadTeam),
        ("POST", "/v1/agents", DriveAgents),
        ("GET", "/v1/agents/{id}", ReadTeam),
        ("DELETE", "/v1/agents/{id}", DriveAgents),
        ("POST", "/v1/agents/{id}/messages", DriveAgents),
        ("GET", "/v1/agents/{id}/messages", ReadTeam),
        (
            "DELETE",
            "/v1/agents/{id}/messages/{message_id}",
            DriveAgents,
        ),
        ("GET", "/v1/queue", ReadTeam),
        ("POST", "/v1/agents/{id}/interrupt", DriveAgents),
        ("PUT", "/v1/agents/{id}/mode", DriveAgents),
        ("PUT", "/v1/agents/{id}/model", DriveAgents),
        ("POST", "/v1/agents/{id}/close", DriveAgents),
        ("GET", "/v1/agents/{id}/wait", ReadTeam),
        ("GET", "/v1/agents/{id}/timeline", ReadTeam),
        ("GET", "/v1/agents/{id}/permissions", ReadTeam),
        (
            "POST",
            "/v1/agents/{id}/permissions/{request_id}",
            DriveAgents,
        ),
        ("GET", "/v1/agents/{id}/events", ReadTeam),
        ("GET", "/v1/events", ReadTeam),
        ("GET", "/v1/providers", ReadSelf),
        ("GET", "/v1/providers/{id}/models", ReadSelf),
        ("GET", "/v1/teams/{id}/secrets", ReadTeam),
        ("PUT", "/v1/teams/{id}/secrets/{name}", ManageTeam),
        ("DELETE", "/v1/teams/{id}/secrets/{name}", ManageTeam),
        ("GET", "/v1/teams/{id}/network", ReadTeam),
        ("PUT", "/v1/teams/{id}/network", ManageTeam),
        ("PUT", "/v1/teams/{id}/sandbox", ManageTeam),
        ("GET", "/v1/teams/{id}/agentry-mcp", ReadTeam),
        ("PUT", "/v1/teams/{id}/agentry-mcp", ManageTeam),
        ("GET", "/v1/teams/{id}/budget", ReadTeam),
        ("PUT", "/v1/teams/{id}/budget", ManageTeam),
        ("GET", "/v1/workspaces/{id}/budget", ReadTeam),
        ("PUT", "/v1/workspaces/{id}/budget", ManageTeam),
        ("GET", "/v1/usage", ReadTeam),
        ("POST", "/v1/hooks", ManageTeam),
        ("GET", "/v1/hooks", ReadAsOwner),
        ("GET", "/v1/hooks/{id}", ReadAsOwner),
        ("PATCH", "/v1/hooks/{id}", ManageTeam),
        ("DELETE", "/v1/hooks/{id}", ManageTeam),
        ("GET", "/v1/hooks/{id}/deliveries", ReadAsOwner),
        (
            "POST",
            "/v1/hooks/{id}/deliveries/{delivery_id}/redeliver",
            ManageTeam,
        ),
        ("POST", "/v1/triggers", ManageTeam),
        ("GET", "/v1/triggers", ReadTeam),
        ("GET", "/v1/triggers/{id}", ReadTeam),
        ("PATCH", "/v1/triggers/{id}", ManageTeam),
        ("DELETE", "/v1/triggers/{id}", ManageTeam),
        ("GET", "/v1/triggers/{id}/runs", ReadTeam),
    ]
};

/// The routes outside `/v1` that answer without an API token, on purpose: health,
/// metrics, the browser sign-in and the device sign-in a client polls before it has a
/// token. (The
/// dashboard's pages and the API documentation are static and not in the document.)
pub const PUBLIC: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    // Its own `[metrics] token` when set.
    ("GET", "/metrics"),
    ("GET", "/auth/login"),
    ("GET", "/auth/callback"),
    ("POST", "/auth/logout"),
    ("POST", "/auth/device"),
    ("POST", "/auth/device/token"),
    // Authenticated by the trigger's secret (signature or token), not by a bearer token.
    ("POST", "/hooks/triggers/{id}"),
];

/// The declared route whose template `path` fits, found segment by segment: each
/// `{name}` stands for one non-empty segment, as in the router. The templates are the
/// router's own patterns (a test holds the document and this table to each other), but
/// the router's lookup runs a regular expression for each pattern it tries, which came
/// to a tenth of a small request's CPU. No path fits two templates (a test says so), so
/// the order in which the router tries them cannot make it answer otherwise.
pub fn declared_pattern(path: &str) -> Option<&'static str> {
    type Template = (&'static str, Vec<Option<&'static str>>);
    static TEMPLATES: OnceLock<Vec<Template>> = OnceLock::new();
    let templates = TEMPLATES.get_or_init(|| {
        let mut seen = HashSet::new();
        ROUTES
            .iter()
            .filter(|(_, p, _)| seen.insert(*p))
            .map(|(_, p, _)| {
                let segments = p
                    .split('/')
                    .map(|s| (!(s.starts_with('{') && s.ends_with('}'))).then_some(s))
                    .collect();
                (*p, segments)
            })
            .collect()
    });
    templates
        .iter()
        .find(|(_, segments)| fits(segments, path))
        .map(|(p, _)| *p)
}

/// Whether `path` has the template's segments: its literals, and a non-empty segment
/// for each parameter (`None`).
fn fits(template: &[Option<&str>], path: &str) -> bool {
    let mut parts = path.split('/');
    let all = template.iter().all(|t| match (t, parts.next()) {
        (Some(literal), Some(part)) => *literal == part,
        (None, Some(part)) => !part.is_empty(),
        (_, None) => false,
    });
    all && parts.next().is_none()
}

/// The operation of a route, when it is declared.
pub fn operation(method: &str, pattern: &str) -> Option<Operation> {
    ROUTES
        .iter()
        .find(|(m, p, _)| *p == pattern && method == *m)
        .map(|(_, _, op)| *op)
}

/// Authenticate every request to a declared route and check its token's scope for the
/// route's operation; the principal then rides in the request's extensions, where the
/// `Principal` extractor takes it from. Requests to undeclared routes go on to the
/// router, which answers 404 or 405 (or, for a handler missing from the table, its
/// extractor refuses).
pub async fn enforce(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let op = super::middleware::route_pattern(req.request())
        .and_then(|pattern| operation(req.method().as_str(), &pattern));
    if let Some(op) = op {
        let checked = match authenticate_request(req.request()).await {
            Ok(principal) => principal
                .authorize(op)
                .map(|()| principal)
                .map_err(ApiError::from),
            Err(e) => Err(e),
        };
        match checked {
            Ok(principal) => {
                req.extensions_mut().insert(principal);
            }
            // Answered here (not raised), so the outer middleware still tags the answer
            // with its request id.
            Err(e) => return Ok(req.error_response(e).map_into_right_body()),
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_route_of_the_document_is_in_the_table_and_no_other() {
        let doc = serde_json::to_value(super::super::docs::document()).unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            if !path.starts_with("/v1/") {
                continue;
            }
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let declared: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|(m, p, _)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(declared.len(), ROUTES.len(), "a route is declared twice");
        let missing: Vec<_> = documented.difference(&declared).collect();
        assert!(
            missing.is_empty(),
            "routes with no access policy (add them to api::access::ROUTES): {missing:?}"
        );
        let stale: Vec<_> = declared.difference(&documented).collect();
        assert!(
            stale.is_empty(),
            "declared routes that do not exist: {stale:?}"
        );
    }

    #[test]
    fn a_path_fits_the_template_the_router_matches_it_with_and_no_other() {
        use actix_web::dev::ResourceDef;
        let templates: BTreeSet<&str> = ROUTES.iter().map(|(_, p, _)| *p).collect();
        // Every template with its parameters filled in, odd values among them, and the
        // near misses of each: a segment more, a trailing slash, an empty parameter.
        let fill = |t: &str, value: &str| {
            t.split('/')
                .map(|s| if s.starts_with('{') { value } else { s })
                .collect::<Vec<_>>()
                .join("/")
        };
        let mut paths: Vec<String> = ["/", "/v1", "/v1/", "/healthz", "/v1/unknown/a", "/v1/me/"]
            .map(str::to_owned)
            .to_vec();
        for t in &templates {
            for value in [
                "agt_01a23d18c9137358921162d4c3881017",
                "a%2Fb",
                "x.y",
                "ä",
                "{id}",
                "",
            ] {
                let path = fill(t, value);
                if !value.is_empty() {
                    assert_eq!(declared_pattern(&path), Some(*t), "{path}");
                }
                paths.push(format!("{path}/"));
                paths.push(format!("{path}/more"));
                paths.push(path);
            }
        }
        for path in &paths {
            let router: Vec<&str> = templates
                .iter()
                .filter(|t| ResourceDef::new(**t).is_match(path))
                .copied()
                .collect();
            assert!(router.len() <= 1, "{path} matches {router:?}");
            assert_eq!(declared_pattern(path), router.first().copied(), "{path}");
        }
    }

    #[test]
    fn every_route_outside_v1_is_declared_public() {
        let doc = serde_json::to_value(super::super::docs::document()).unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            if path.starts_with("/v1/") {
                continue;
            }
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let declared: BTreeSet<(String, String)> = PUBLIC
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(
            documented, declared,
            "a route outside /v1 needs no credentials: declare it in api::access::PUBLIC"
        );
    }

    #[test]
    fn reads_read_and_everything_else_changes() {
        for (method, path, op) in ROUTES {
            assert_eq!(
                *method != "GET",
                op.mutates(),
                "{method} {path} is declared as {op:?}"
            );
        }
    }
}
