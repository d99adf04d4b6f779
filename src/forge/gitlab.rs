//! GitLab's REST API (v4): merge requests and the pipeline of their head.

use serde_json::{Value, json};

use super::{
    Checks, Endpoint, Forge, ForgeError, Review, ReviewSpec, ReviewState, malformed, send,
};

pub struct GitLab<'a>(pub Endpoint<'a>);

impl GitLab<'_> {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let e = &self.0;
        let id = url::form_urlencoded::byte_serialize(e.repo.as_bytes()).collect::<String>();
        e.http
            .request(method, format!("{}/projects/{id}{path}", e.api))
            .header("PRIVATE-TOKEN", e.token)
    }

    /// The log (trace) of job `job`, at most `max` bytes of its end.
    pub async fn job_trace(&self, job: i64, max: usize) -> Result<String, ForgeError> {
        super::send_text(
            self.request(reqwest::Method::GET, &format!("/jobs/{job}/trace")),
            max,
        )
        .await
    }
}

fn review(v: &Value) -> Result<Review, ForgeError> {
    let number = v["iid"].as_i64().ok_or_else(|| malformed("`iid`"))?;
    let url = v["web_url"]
        .as_str()
        .ok_or_else(|| malformed("`web_url`"))?;
    let state = match v["state"].as_str() {
        Some("opened" | "locked") => ReviewState::Open,
        Some("merged") => ReviewState::Merged,
        Some("closed") => ReviewState::Closed,
        _ => return Err(malformed("`state`")),
    };
    Ok(Review {
        number,
        url: url.to_owned(),
        state,
        head_sha: v["sha"].as_str().map(str::to_owned),
    })
}

/// The checks of a merge request from the status of its head pipeline.
fn checks(mr: &Value) -> Checks {
    match mr["head_pipeline"]["status"].as_str() {
        None => Checks::None,
        Some("success") => Checks::Passing,
        Some("failed" | "canceled") => Checks::Failing,
        Some("skipped") => Checks::None,
        Some(_) => Checks::Pending,
    }
}

impl Forge for GitLab<'_> {
    async fn find_open(&self, head: &str) -> Result<Option<Review>, ForgeError> {
        let list = send(self.request(
            reqwest::Method::GET,
            &format!(
                "/merge_requests?{}",
                super::query(&[("source_branch", head), ("state", "opened")])
            ),
        ))
        .await?;
        match list.as_array().and_then(|a| a.first()) {
            Some(first) => review(first).map(Some),
            None => Ok(None),
        }
    }

    async fn create(&self, spec: &ReviewSpec<'_>) -> Result<Review, ForgeError> {
        let v = send(
            self.request(reqwest::Method::POST, "/merge_requests")
                .json(&json!({
                    "source_branch": spec.head, "target_branch": spec.base,
                    "title": spec.title, "description": spec.body,
                })),
        )
        .await?;
        review(&v)
    }

    async fn update(&self, number: i64, spec: &ReviewSpec<'_>) -> Result<Review, ForgeError> {
        let v = send(
            self.request(reqwest::Method::PUT, &format!("/merge_requests/{number}"))
                .json(&json!({"title": spec.title, "description": spec.body})),
        )
        .await?;
        review(&v)
    }

    async fn status(&self, number: i64) -> Result<(Review, Checks), ForgeError> {
        let v =
            send(self.request(reqwest::Method::GET, &format!("/merge_requests/{number}"))).await?;
        Ok((review(&v)?, checks(&v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_status_summarizes() {
        let of = |s: Value| checks(&json!({ "head_pipeline": s }));
        assert_eq!(checks(&json!({"head_pipeline": null})), Checks::None);
        assert_eq!(of(json!({"status": "running"})), Checks::Pending);
        assert_eq!(of(json!({"status": "failed"})), Checks::Failing);
        assert_eq!(of(json!({"status": "success"})), Checks::Passing);
    }
}
