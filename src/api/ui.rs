//! The dashboard: one page and its two assets, built into the binary (no CDN, no build
//! step), served at `/` and at the page addresses the page itself routes: `/agents/{id}`,
//! `/workspaces`, `/workspaces/{id}`, `/new`, `/teams`, `/teams/{id}`, `/usage`,
//! `/teams/{id}/usage` and `/device` (where a person approves a device sign-in, see
//! `api::device`). The
//! page calls the same `/v1` API as every client, with the person's token or their
//! browser session.

use actix_web::http::header;
use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::api::AppState;

const INDEX: &str = include_str!("../../ui/index.html");
const SCRIPT: &str = include_str!("../../ui/app.js");
const STYLE: &str = include_str!("../../ui/app.css");

/// Nothing but this server's own files, and no framing by other sites.
const POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; \
    frame-ancestors 'none'";

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(index))
        .route("/agents/{id}", web::get().to(index))
        .route("/workspaces", web::get().to(index))
        .route("/workspaces/{id}", web::get().to(index))
        .route("/new", web::get().to(index))
        .route("/teams", web::get().to(index))
        .route("/teams/{id}", web::get().to(index))
        .route("/teams/{id}/usage", web::get().to(index))
        .route("/usage", web::get().to(index))
        .route("/device", web::get().to(index))
        .route("/ui/app.js", web::get().to(script))
        .route("/ui/app.css", web::get().to(style))
        .route("/ui/config", web::get().to(config));
}

fn page(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, content_type))
        .insert_header((header::CONTENT_SECURITY_POLICY, POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "same-origin"))
        // Small files; a new server version must reach the browser at once.
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(body)
}

async fn index() -> HttpResponse {
    page("text/html; charset=utf-8", INDEX)
}

async fn script() -> HttpResponse {
    page("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> HttpResponse {
    page("text/css; charset=utf-8", STYLE)
}

/// What the sign-in page offers: the browser flow when OpenID Connect is configured.
async fn config(state: web::Data<AppState>) -> HttpResponse {
    let oidc = state
        .settings
        .auth
        .oidc
        .as_ref()
        .is_some_and(|o| o.redirect_url.is_some());
    HttpResponse::Ok().json(json!({"oidc": oidc}))
}
