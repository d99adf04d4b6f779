//! GitHub's REST API: pull requests and the check runs of their head commit.

use serde_json::{Value, json};

use super::{
    Checks, Endpoint, Forge, ForgeError, Review, ReviewSpec, ReviewState, malformed, send,
};

pub struct GitHub<'a>(pub Endpoint<'a>);

impl GitHub<'_> {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let e = &self.0;
        e.http
            .request(method, format!("{}/repos/{}{path}", e.api, e.repo))
            .header("Accept", "application/vnd.github+json")
            .header("X-GitHub-Api-Version", "2022-11-28")
            .bearer_auth(e.token)
    }
}

impl GitHub<'_> {
    /// The jobs of workflow run `run` (its latest attempt) that failed: id and name.
    pub async fn failed_jobs(&self, run: i64) -> Result<Vec<(i64, String)>, ForgeError> {
        let v = send(self.request(
            reqwest::Method::GET,
            &format!(
                "/actions/runs/{run}/jobs?{}",
                super::query(&[("filter", "latest"), ("per_page", "100")])
            ),
        ))
        .await?;
        let jobs = v["jobs"].as_array().ok_or_else(|| malformed("`jobs`"))?;
        Ok(jobs
            .iter()
            .filter(|j| matches!(j["conclusion"].as_str(), Some("failure" | "timed_out")))
            .filter_map(|j| {
                Some((
                    j["id"].as_i64()?,
                    j["name"].as_str().unwrap_or("a job").to_owned(),
                ))
            })
            .collect())
    }

    /// The end (at most `max` bytes) of the log of job `job`. GitHub answers with a
    /// redirect to a short-lived address of the text; that address is read without the
    /// token (it carries its own grant, and may be another host).
    pub async fn job_log(&self, job: i64, max: usize) -> Result<String, ForgeError> {
        let answer = self
            .request(reqwest::Method::GET, &format!("/actions/jobs/{job}/logs"))
            .timeout(super::CALL_TIMEOUT)
            .send()
            .await
            .map_err(|e| ForgeError::Unavailable(super::without_url(&e)))?;
        if !answer.status().is_redirection() {
            return super::read_text(answer, max).await;
        }
        let location = answer
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| malformed("the log's address"))?;
        let target = answer
            .url()
            .join(location)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https"))
            .ok_or_else(|| malformed("a usable address of the log"))?;
        super::send_text(self.0.http.get(target), max).await
    }
}

fn review(v: &Value) -> Result<Review, ForgeError> {
    let number = v["number"].as_i64().ok_or_else(|| malformed("`number`"))?;
    let url = v["html_url"]
        .as_str()
        .ok_or_else(|| malformed("`html_url`"))?;
    let state = match (
        v["state"].as_str(),
        v["merged"].as_bool(),
        v["merged_at"].is_string(),
    ) {
        (_, Some(true), _) | (_, _, true) => ReviewState::Merged,
        (Some("open"), _, _) => ReviewState::Open,
        (Some("closed"), _, _) => ReviewState::Closed,
        _ => return Err(malformed("`state`")),
    };
    Ok(Review {
        number,
        url: url.to_owned(),
        state,
        head_sha: v["head"]["sha"].as_str().map(str::to_owned),
    })
}

/// The checks of a commit from its check runs.
fn checks(runs: &Value) -> Checks {
    let Some(runs) = runs["check_runs"].as_array() else {
        return Checks::None;
    };
    if runs.is_empty() {
        return Checks::None;
    }
    let mut pending = false;
    for run in runs {
        if run["status"].as_str() != Some("completed") {
            pending = true;
            continue;
        }
        match run["conclusion"].as_str() {
            Some("success" | "neutral" | "skipped") => {}
            _ => return Checks::Failing,
        }
    }
    if pending {
        Checks::Pending
    } else {
        Checks::Passing
    }
}

impl Forge for GitHub<'_> {
    async fn find_open(&self, head: &str) -> Result<Option<Review>, ForgeError> {
        let owner = self.0.repo.split('/').next().unwrap_or_default();
        let list = send(self.request(
            reqwest::Method::GET,
            &format!(
                "/pulls?{}",
                super::query(&[("head", &format!("{owner}:{head}")), ("state", "open")])
            ),
        ))
        .await?;
        match list.as_array().and_then(|a| a.first()) {
            Some(first) => review(first).map(Some),
            None => Ok(None),
        }
    }

    async fn create(&self, spec: &ReviewSpec<'_>) -> Result<Review, ForgeError> {
        let v = send(self.request(reqwest::Method::POST, "/pulls").json(&json!({
            "title": spec.title, "body": spec.body, "head": spec.head, "base": spec.base,
        })))
        .await?;
        review(&v)
    }

    async fn update(&self, number: i64, spec: &ReviewSpec<'_>) -> Result<Review, ForgeError> {
        let v = send(
            self.request(reqwest::Method::PATCH, &format!("/pulls/{number}"))
                .json(&json!({"title": spec.title, "body": spec.body})),
        )
        .await?;
        review(&v)
    }

    async fn status(&self, number: i64) -> Result<(Review, Checks), ForgeError> {
        let v = send(self.request(reqwest::Method::GET, &format!("/pulls/{number}"))).await?;
        let pr = review(&v)?;
        let checks = match &pr.head_sha {
            Some(sha) => {
                let runs =
                    send(self.request(reqwest::Method::GET, &format!("/commits/{sha}/check-runs")))
                        .await?;
                checks(&runs)
            }
            None => Checks::None,
        };
        Ok((pr, checks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_runs_summarize() {
        let runs = |v: Value| checks(&json!({ "check_runs": v }));
        assert_eq!(runs(json!([])), Checks::None);
        assert_eq!(
            runs(json!([{"status": "completed", "conclusion": "success"},
                {"status": "in_progress", "conclusion": null}])),
            Checks::Pending
        );
        assert_eq!(
            runs(json!([{"status": "completed", "conclusion": "failure"},
                {"status": "queued", "conclusion": null}])),
            Checks::Failing
        );
        assert_eq!(
            runs(json!([{"status": "completed", "conclusion": "skipped"},
                {"status": "completed", "conclusion": "success"}])),
            Checks::Passing
        );
    }
}
