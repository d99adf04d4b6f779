//! The API's own description: the OpenAPI document (generated from the handlers, served
//! at `/openapi.json`, committed as `openapi/openapi.json`), the Swagger UI at `/docs`
//! (assets built into the binary) and the router's 404/405 answers.

use std::sync::OnceLock;

use actix_web::http::{Method, StatusCode, header};
use actix_web::{App, HttpRequest, HttpResponse, web};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Components, InfoBuilder, OpenApi, OpenApiBuilder};
use utoipa_actix_web::AppExt;
use utoipa_swagger_ui::{Config, SwaggerUi};

use super::error::ApiError;

/// Title, version and security scheme; paths and schemas are collected from handlers.
pub fn base() -> OpenApi {
    let mut components = Components::new();
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "An agentry API token (`agt_pat_…`) or an OIDC access token",
                ))
                .build(),
        ),
    );
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("agentry")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "Run AI coding agents for a team: projects, worktree workspaces, agents with durable \
                     timelines, permission requests and live Server-Sent Event streams.",
                ))
                .build(),
        )
        .components(Some(components))
        .build()
}

/// The whole document, built from the same route table the server uses.
pub fn document() -> &'static OpenApi {
    static DOC: OnceLock<OpenApi> = OnceLock::new();
    DOC.get_or_init(|| {
        let (_, api) = App::new()
            .into_utoipa_app()
            .openapi(base())
            .configure(|cfg| super::configure(cfg, 1024 * 1024))
            .split_for_parts();
        super::openapi::complete(api)
    })
}

/// The document as committed in `openapi/openapi.json`.
pub fn document_json() -> String {
    let mut s = document()
        .to_pretty_json()
        .expect("the OpenAPI document serialises");
    s.push('\n');
    s
}

/// `/openapi.json`: the document as JSON, serialised on the first request and kept.
pub async fn served_document() -> HttpResponse {
    static BYTES: OnceLock<web::Bytes> = OnceLock::new();
    let body = BYTES.get_or_init(|| {
        serde_json::to_vec(document())
            .expect("the OpenAPI document serialises")
            .into()
    });
    HttpResponse::Ok()
        .content_type(header::ContentType::json())
        .body(body.clone())
}

/// The Swagger UI, pointed at `/openapi.json`. It holds no copy of the document: each
/// worker would keep one, and the document is built only when someone asks for it.
pub fn swagger() -> SwaggerUi {
    SwaggerUi::new("/docs/{_:.*}").config(Config::new(["/openapi.json"]))
}

pub async fn redirect_to_ui() -> HttpResponse {
    HttpResponse::Found()
        .insert_header((header::LOCATION, "/docs/"))
        .finish()
}

/// No route matched: 405 when the path exists with other methods, else 404.
pub async fn fallback(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    let allowed = allowed_methods(req.path());
    if allowed.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "route_not_found",
            format!("no route for {}", req.path()),
        ));
    }
    let allow = allowed
        .iter()
        .map(|m| m.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not allowed on {}; use {allow}",
            req.method(),
            req.path()
        ),
    );
    let mut res = actix_web::ResponseError::error_response(&e);
    if let Ok(v) = header::HeaderValue::from_str(&allow) {
        res.headers_mut().insert(header::ALLOW, v);
    }
    Ok(res)
}

fn allowed_methods(path: &str) -> Vec<Method> {
    static ROUTES: OnceLock<Vec<(Vec<String>, Vec<Method>)>> = OnceLock::new();
    let routes = ROUTES.get_or_init(|| {
        let doc = serde_json::to_value(document()).unwrap_or_default();
        let mut out = Vec::new();
        if let Some(paths) = doc.get("paths").and_then(|p| p.as_object()) {
            for (p, item) in paths {
                let segs = p.trim_matches('/').split('/').map(str::to_owned).collect();
                let methods = item
                    .as_object()
                    .map(|o| {
                        o.keys()
                            .filter_map(|k| {
                                Method::from_bytes(k.to_ascii_uppercase().as_bytes()).ok()
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push((segs, methods));
            }
        }
        out
    });
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let mut allowed = Vec::new();
    for (pattern, methods) in routes {
        if pattern.len() == segs.len()
            && pattern
                .iter()
                .zip(&segs)
                .all(|(p, s)| p.starts_with('{') || p == s)
        {
            for m in methods {
                if !allowed.contains(m) {
                    allowed.push(m.clone());
                }
            }
        }
    }
    allowed
}
