//! A small HTTP client for the daemon's control API.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use p2ptrain_daemon::status::ApiErrorBody;
use serde::de::DeserializeOwned;

/// Talks to one daemon.
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// A client for the daemon at `addr` (`host:port` or a full `http://` URL), with `token`,
    /// else the one the node listed for this user under its address (see
    /// `p2ptrain_daemon::control::token`), so that nobody types it.
    pub fn new(addr: &str, token: Option<String>) -> Result<Client> {
        let token = token
            .filter(|t| !t.is_empty())
            .or_else(|| p2ptrain_daemon::control::token::lookup(addr));
        let base = if addr.starts_with("http://") || addr.starts_with("https://") {
            addr.trim_end_matches('/').to_string()
        } else {
            format!("http://{addr}")
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(120))
            .build()
            .context("cannot build HTTP client")?;
        Ok(Client { base, token, http })
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() {
                anyhow!(
                    "cannot reach a p2ptrain daemon at {} (connection refused or unreachable); is one running? start it with `p2ptrain join`, or point --api at it",
                    self.base
                )
            } else if e.is_timeout() {
                anyhow!("the daemon at {} did not answer in time", self.base)
            } else {
                anyhow!("request to {} failed: {e}", self.base)
            }
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let msg = serde_json::from_str::<ApiErrorBody>(&text)
            .map(|b| b.error)
            .unwrap_or(text);
        Err(anyhow!("daemon answered {status}: {msg}"))
    }

    /// GET a JSON document.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let resp = self
            .send(self.http.get(format!("{}{path}", self.base)))
            .await?;
        resp.json()
            .await
            .context("daemon sent a response this CLI cannot read")
    }

    /// POST with no body; read a JSON answer.
    pub async fn post<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let resp = self
            .send(self.http.post(format!("{}{path}", self.base)))
            .await?;
        resp.json()
            .await
            .context("daemon sent a response this CLI cannot read")
    }

    /// GET raw bytes.
    pub async fn get_bytes(&self, path: &str) -> Result<Vec<u8>> {
        let resp = self
            .send(self.http.get(format!("{}{path}", self.base)))
            .await?;
        Ok(resp.bytes().await.context("download interrupted")?.to_vec())
    }
}
