//! A team's network policy: the entries its owners add to the egress allow lists of the
//! team's agents (read by any member of the team, set by owners).

use actix_web::{get, put, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiResult, Problem};
use super::parse_id;
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::TeamId;
use crate::services::network::{self, PutTeamNetwork, TeamNetwork};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(get_network).service(put_network);
}

/// The hosts the team adds to its agents' egress allow lists (any member of the team).
/// An agent's whole list is its provider's, the server's (`[egress]`) and these.
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")),
    responses((status = 200, body = TeamNetwork), (status = 404, body = Problem)))]
#[get("/teams/{id}/network")]
async fn get_network(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
) -> ApiResult<web::Json<TeamNetwork>> {
    let team: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        network::get(&state.services.data, &principal, team).await?,
    ))
}

/// Replace the team's allow-list entries (team owners; audited as `network.set`). Each
/// entry is `host`, `*.suffix`, `*` or an IP literal, with an optional `:port`; at most
/// 100. A bad entry: 422 `validation_failed` naming it (`allow[<index>]`).
#[utoipa::path(tag = "teams", security(("bearer" = [])),
    params(("id" = String, Path, description = "The team")),
    request_body = PutTeamNetwork,
    responses((status = 200, body = TeamNetwork), (status = 403, body = Problem),
        (status = 404, body = Problem), (status = 422, body = Problem)))]
#[put("/teams/{id}/network")]
async fn put_network(
    state: web::Data<AppState>,
    principal: Principal,
    id: web::Path<String>,
    body: web::Json<PutTeamNetwork>,
) -> ApiResult<web::Json<TeamNetwork>> {
    let team: TeamId = parse_id(&id, "team")?;
    Ok(web::Json(
        network::put(&state.services.data, &principal, team, &body).await?,
    ))
}
