//! Who may use the control API: every request must name a host this API answers to, come
//! from no foreign web page, and carry the access token.
//!
//! - **Host**: an IP literal, `localhost`, or a name in `api.allowed_hosts`. A web page that
//!   rebinds its own domain name to 127.0.0.1 (DNS rebinding) still sends its own name as
//!   Host, so it is refused before it can read anything.
//! - **Origin**: a browser names the page a request comes from; one that is not this API's
//!   own (`http://` or `https://` and the Host) is refused, so a page the operator has open
//!   cannot POST `stop` or `restore` even if it guessed the token.
//! - **Token**: `Authorization: Bearer <token>`, or `?token=` for the page a browser opens.
//!   Compared through SHA-256 digests, so the time taken tells neither where the strings
//!   differ nor how long the token is.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::sync::Arc;

use super::ApiError;

/// What the API checks each request against.
#[derive(Debug, Clone)]
pub struct Access {
    /// The secret every request must carry.
    pub token: String,
    /// Host names the API answers to besides IP literals and `localhost`
    /// (`api.allowed_hosts`), lower case.
    pub allowed_hosts: Vec<String>,
}

/// Compares two secrets in time that depends on neither their contents nor their lengths.
fn same_secret(given: &[u8], token: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(given), Sha256::digest(token));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// The host part of a `Host` header value (`name`, `name:port`, `1.2.3.4:port`,
/// `[::1]:port`), lower case.
fn host_name(host: &str) -> String {
    let host = host.trim();
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.to_ascii_lowercase()
}

impl Access {
    /// Whether a request naming `host` is for this API.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        name.parse::<std::net::IpAddr>().is_ok()
            || name == "localhost"
            || self.allowed_hosts.contains(&name)
    }

    /// Why a request is refused, if it is: its Host, its Origin, then its token.
    fn refusal(&self, headers: &HeaderMap, query: Option<&str>) -> Option<ApiError> {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !self.host_allowed(host) {
            return Some(ApiError(
                StatusCode::FORBIDDEN,
                format!(
                    "Host {host:?} is not one this API answers to (an IP address, localhost, \
                     or a name in api.allowed_hosts)"
                ),
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("").to_ascii_lowercase();
            let own = [
                format!("http://{}", host.to_ascii_lowercase()),
                format!("https://{}", host.to_ascii_lowercase()),
            ];
            if !own.contains(&origin) {
                return Some(ApiError(
                    StatusCode::FORBIDDEN,
                    format!("requests from another origin ({origin}) are refused"),
                ));
            }
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                // The scheme's name is case-insensitive (RFC 7235).
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(token)
            })
            .or_else(|| query_token(query))
            .unwrap_or("");
        if !same_secret(given.as_bytes(), self.token.as_bytes()) {
            return Some(ApiError(
                StatusCode::UNAUTHORIZED,
                "missing or wrong access token (the CLI finds it by itself for the user who \
                 started the node; else it is in the node's data directory, api.token)"
                    .into(),
            ));
        }
        None
    }
}

/// The `token` parameter of a query string, if there is one.
fn query_token(query: Option<&str>) -> Option<&str> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("token="))
}

/// The middleware: refuses what [`Access`] does not let through.
pub async fn check(State(access): State<Arc<Access>>, req: Request, next: Next) -> Response {
    match access.refusal(req.headers(), req.uri().query()) {
        Some(refused) => refused.into_response(),
        None => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn access() -> Access {
        Access {
            token: "s3cret".into(),
            allowed_hosts: vec!["lab-box.lan".into()],
        }
    }

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    fn refused(h: &HeaderMap, query: Option<&str>) -> Option<StatusCode> {
        access().refusal(h, query).map(|e| e.0)
    }

    /// The token in a header or the query lets a request through; none, a wrong one, a
    /// prefix of it or a longer one does not.
    #[test]
    fn only_the_token_lets_a_request_through() {
        let host = (header::HOST, "127.0.0.1:7070");
        let with = |auth: &str| headers(&[host.clone(), (header::AUTHORIZATION, auth)]);
        assert_eq!(refused(&with("Bearer s3cret"), None), None);
        assert_eq!(refused(&with("bearer s3cret"), None), None);
        assert_eq!(
            refused(
                &headers(std::slice::from_ref(&host)),
                Some("a=1&token=s3cret")
            ),
            None
        );
        for bad in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Bearer ",
            "s3cret",
            "Basic s3cret",
        ] {
            assert_eq!(
                refused(&with(bad), None),
                Some(StatusCode::UNAUTHORIZED),
                "{bad}"
            );
        }
        assert_eq!(
            refused(&headers(&[host]), Some("token=nope")),
            Some(StatusCode::UNAUTHORIZED)
        );
        assert!(!same_secret(b"", b"s3cret") && same_secret(b"s3cret", b"s3cret"));
    }

    /// IP literals, localhost and the allowed names pass; a rebound domain name, a missing
    /// Host and a foreign Origin are refused even with the token.
    #[test]
    fn a_foreign_host_or_origin_is_refused_even_with_the_token() {
        let auth = (header::AUTHORIZATION, "Bearer s3cret");
        for host in [
            "127.0.0.1:7070",
            "localhost:7070",
            "LOCALHOST",
            "[::1]:7070",
            "10.0.0.5:7070",
            "lab-box.lan:7070",
        ] {
            assert_eq!(
                refused(&headers(&[(header::HOST, host), auth.clone()]), None),
                None,
                "{host}"
            );
        }
        for host in ["evil.example:7070", "evil.example", ""] {
            assert_eq!(
                refused(&headers(&[(header::HOST, host), auth.clone()]), None),
                Some(StatusCode::FORBIDDEN),
                "{host}"
            );
        }
        let host = (header::HOST, "127.0.0.1:7070");
        assert_eq!(
            refused(
                &headers(&[
                    host.clone(),
                    auth.clone(),
                    (header::ORIGIN, "http://127.0.0.1:7070")
                ]),
                None
            ),
            None
        );
        for origin in ["https://evil.example", "http://127.0.0.1:8080", "null"] {
            assert_eq!(
                refused(
                    &headers(&[host.clone(), auth.clone(), (header::ORIGIN, origin)]),
                    None
                ),
                Some(StatusCode::FORBIDDEN),
                "{origin}"
            );
        }
    }
}
