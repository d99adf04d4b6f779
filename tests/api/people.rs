//! People of a local team for tests: an admin creates users and issues their tokens, and
//! each person calls the API with their own token.

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;

/// Someone calling the API with one token.
#[derive(Clone)]
pub struct Caller {
    base: String,
    client: reqwest::Client,
    pub token: String,
}

impl Caller {
    pub fn new(app: &TestApp, token: &str) -> Self {
        Self {
            base: app.base.clone(),
            client: app.client.clone(),
            token: token.to_owned(),
        }
    }

    /// One request; answers the status, the body (Null for an event stream, which is
    /// not read) and the `X-Request-Id` of the answer.
    pub async fn call_full(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        request_id: Option<&str>,
    ) -> (u16, Value, String) {
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(b);
        }
        if let Some(id) = request_id {
            req = req.header("X-Request-Id", id);
        }
        let res = req.send().await.unwrap();
        let status = res.status().as_u16();
        let rid = res
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let is_stream = res
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if is_stream {
            return (status, Value::Null, rid);
        }
        let text = res.text().await.unwrap();
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, body, rid)
    }

    /// A request with an `Idempotency-Key`; answers the status, the body and the
    /// `X-Request-Id`.
    pub async fn call_full_with_key(
        &self,
        method: Method,
        path: &str,
        body: &Value,
        key: &str,
    ) -> (u16, Value, String) {
        let res = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let rid = res
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let text = res.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::Null),
            rid,
        )
    }

    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let (s, b, _) = self.call_full(method, path, body.as_ref(), None).await;
        (s, b)
    }

    /// A request that must answer `status`; returns the body.
    pub async fn ok(&self, method: Method, path: &str, body: Option<Value>, status: u16) -> Value {
        let (got, body) = self.call(method.clone(), path, body).await;
        assert_eq!(got, status, "{method} {path} answered {body}");
        body
    }

    /// A request that must fail with `status` and `code`.
    pub async fn refused(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        status: u16,
        code: &str,
    ) {
        let (got, body) = self.call(method.clone(), path, body).await;
        assert_eq!(
            (got, body["code"].as_str()),
            (status, Some(code)),
            "{method} {path} answered {body}"
        );
    }
}

/// A user of the local mode with a personal token.
pub struct Person {
    pub id: String,
    pub api: Caller,
}

/// The admin creates `name` (email `<name>@example.com`) and issues their token.
pub async fn person(app: &TestApp, name: &str) -> Person {
    let admin = Caller::new(app, &app.token);
    let email = format!("{name}@example.com");
    let user = admin
        .ok(
            Method::POST,
            "/v1/users",
            Some(json!({"email": email, "name": name})),
            201,
        )
        .await;
    let id = user["id"].as_str().unwrap().to_owned();
    let token = admin
        .ok(
            Method::POST,
            &format!("/v1/users/{id}/tokens"),
            Some(json!({"name": format!("{name}'s laptop")})),
            201,
        )
        .await;
    Person {
        id,
        api: Caller::new(app, token["token"].as_str().unwrap()),
    }
}

/// `owner` creates a team; returns its id.
pub async fn team(owner: &Person, name: &str) -> String {
    let t = owner
        .api
        .ok(Method::POST, "/v1/teams", Some(json!({"name": name})), 201)
        .await;
    assert_eq!(t["role"], "owner");
    t["id"].as_str().unwrap().to_owned()
}

/// `owner` adds `who` to `team` with `role`.
pub async fn add(owner: &Person, team: &str, who: &Person, role: &str) {
    owner
        .api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team}/members/{}", who.id),
            Some(json!({"role": role})),
            201,
        )
        .await;
}
