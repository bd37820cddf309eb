//! `http` tools: the arguments as a JSON body (as query parameters for GET and DELETE), header
//! values from the environment, a bounded response; a non-2xx status is an error result.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{ToolError, excerpt, json_or_text};
use crate::workspace::HttpMethod;

pub(super) struct HttpTool<'a> {
    pub method: HttpMethod,
    pub url: &'a str,
    pub headers_env: &'a BTreeMap<String, String>,
    pub max_response_bytes: u64,
    pub idempotency_key: &'a str,
}

pub(super) async fn run(
    client: &reqwest::Client,
    tool: HttpTool<'_>,
    arguments: &Value,
) -> Result<Value, ToolError> {
    let method = match tool.method {
        HttpMethod::Get => reqwest::Method::GET,
        HttpMethod::Post => reqwest::Method::POST,
        HttpMethod::Put => reqwest::Method::PUT,
        HttpMethod::Patch => reqwest::Method::PATCH,
        HttpMethod::Delete => reqwest::Method::DELETE,
    };
    let mut request = client.request(method.clone(), tool.url);
    request = if matches!(method, reqwest::Method::GET | reqwest::Method::DELETE) {
        let query: Vec<(String, String)> = arguments
            .as_object()
            .map(|fields| {
                fields
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.as_str()
                                .map(str::to_owned)
                                .unwrap_or_else(|| v.to_string()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        request.query(&query)
    } else {
        request.json(arguments)
    };
    request = request.header("idempotency-key", tool.idempotency_key);
    for (header, variable) in tool.headers_env {
        let value = std::env::var(variable).map_err(|_| {
            ToolError::new(
                "unavailable",
                format!("environment variable {variable} (header {header}) is not set"),
            )
        })?;
        request = request.header(header.as_str(), value);
    }
    let response = request.send().await.map_err(|error| {
        let what = if error.is_connect() {
            crate::net::connect_failure(&error)
        } else {
            "the request failed"
        };
        ToolError::new("unavailable", format!("{what}: {}", error.without_url()))
    })?;
    let status = response.status();
    let body = crate::net::read_capped(response, tool.max_response_bytes)
        .await
        .map_err(|error| {
            let code = match error {
                crate::net::BodyError::TooLarge(_) => "output_too_large",
                crate::net::BodyError::Read(_) => "unavailable",
            };
            ToolError::new(code, error.to_string())
        })?;
    if !status.is_success() {
        return Err(ToolError::new(
            "http_status",
            format!(
                "the tool's service answered {}: {}",
                status.as_u16(),
                excerpt(&String::from_utf8_lossy(&body))
            ),
        ));
    }
    Ok(json_or_text(&body))
}
