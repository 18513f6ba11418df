//! The web console, served at `/console/`: a single-page application (plain HTML, CSS and
//! ES modules, no build step, nothing fetched from elsewhere) that talks to the admin API
//! `/api/v1` of the same origin with the operator's credentials.
//!
//! The assets are compiled into the binary, so the console works offline and always matches
//! the API of the binary serving it. Every answer carries a strict Content-Security-Policy
//! (only this origin; no inline script or style) and `Cache-Control: no-cache` (the browser
//! revalidates, so an upgrade is seen at once).

use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use crate::problem::Problem;

/// Only this origin, for everything; no inline script or style, no plugins, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One file of the console.
struct Asset {
    /// Its path under `/console/`.
    path: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const SVG: &str = "image/svg+xml";

macro_rules! asset {
    ($path:literal, $content_type:expr) => {
        Asset {
            path: $path,
            content_type: $content_type,
            body: include_str!(concat!("../../console/", $path)),
        }
    };
}

/// Every asset, `index.html` first.
const ASSETS: &[Asset] = &[
    asset!("index.html", HTML),
    asset!("style.css", CSS),
    asset!("icon.svg", SVG),
    asset!("app.js", JS),
    asset!("api.js", JS),
    asset!("dom.js", JS),
    asset!("format.js", JS),
    asset!("graph.js", JS),
    asset!("channels.js", JS),
    asset!("builder.js", JS),
    asset!("fields.js", JS),
    asset!("cluster.js", JS),
    asset!("events.js", JS),
];

/// `GET /console` (a redirect to `/console/`), `GET /console/` (the application) and
/// `GET /console/{path}` (its assets). Stateless: merge it into any router.
pub fn routes() -> Router {
    Router::new()
        .route(
            "/console",
            get(|| async { Redirect::permanent("/console/") }).fallback(get_only),
        )
        .route("/console/", get(index).fallback(get_only))
        .route("/console/{*path}", get(asset).fallback(get_only))
}

async fn index() -> Response {
    serve(&ASSETS[0])
}

async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.path == path) {
        Some(asset) => serve(asset),
        None => Problem::not_found(&format!("/console/{path}")).into_response(),
    }
}

async fn get_only(method: Method) -> Problem {
    Problem::method_not_allowed(method.as_str(), "GET, HEAD")
}

fn serve(asset: &Asset) -> Response {
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static(asset.content_type),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        ),
    ];
    (headers, asset.body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt;

    async fn get(path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
        let response = routes()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn header(headers: &axum::http::HeaderMap, name: header::HeaderName) -> &str {
        headers
            .get(&name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .to_str()
            .unwrap()
    }

    #[tokio::test]
    async fn the_bare_path_redirects_to_the_application() {
        let (status, headers, _) = get("/console").await;
        assert!(status.is_redirection(), "{status}");
        assert_eq!(header(&headers, header::LOCATION), "/console/");
    }

    #[tokio::test]
    async fn the_index_is_served() {
        let (status, headers, body) = get("/console/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(header(&headers, header::CONTENT_TYPE), HTML);
        assert_eq!(header(&headers, header::CACHE_CONTROL), "no-cache");
        assert!(body.starts_with("<!doctype html>"), "{body}");
        assert!(body.contains(r#"<script type="module" src="app.js"></script>"#));
        assert!(body.contains(r#"href="style.css""#));
        // The same document under its own name.
        let (status, _, again) = get("/console/index.html").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(again, body);
    }

    #[tokio::test]
    async fn each_asset_has_its_content_type() {
        for asset in ASSETS {
            let (status, headers, body) = get(&format!("/console/{}", asset.path)).await;
            assert_eq!(status, StatusCode::OK, "{}", asset.path);
            let expected = match asset.path.rsplit_once('.').map(|(_, ext)| ext) {
                Some("html") => HTML,
                Some("js") => JS,
                Some("css") => CSS,
                Some("svg") => SVG,
                other => panic!("{}: unexpected extension {other:?}", asset.path),
            };
            assert_eq!(
                header(&headers, header::CONTENT_TYPE),
                expected,
                "{}",
                asset.path
            );
            assert_eq!(header(&headers, header::CACHE_CONTROL), "no-cache");
            assert_eq!(header(&headers, header::X_CONTENT_TYPE_OPTIONS), "nosniff");
            assert_eq!(body, asset.body);
        }
    }

    #[tokio::test]
    async fn every_answer_has_a_strict_content_security_policy() {
        for path in ["/console/", "/console/app.js", "/console/style.css"] {
            let (_, headers, _) = get(path).await;
            let csp = header(&headers, header::CONTENT_SECURITY_POLICY);
            assert!(csp.starts_with("default-src 'self';"), "{csp}");
            assert!(csp.contains("script-src 'self';"), "{csp}");
            assert!(csp.contains("object-src 'none'"), "{csp}");
            assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
            assert!(
                !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
                "{csp}"
            );
        }
    }

    #[tokio::test]
    async fn an_unknown_asset_is_a_problem_404() {
        for path in [
            "/console/nope.js",
            "/console/../Cargo.toml",
            "/console/a/b/c",
        ] {
            let (status, headers, body) = get(path).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
            assert_eq!(
                header(&headers, header::CONTENT_TYPE),
                crate::problem::PROBLEM_JSON
            );
            let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(problem["status"], 404, "{body}");
        }
        let (_, _, body) = get("/console/nope.js").await;
        assert!(body.contains("/console/nope.js"), "{body}");
    }

    #[tokio::test]
    async fn other_methods_are_refused() {
        let response = routes()
            .oneshot(
                Request::post("/console/app.js")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(response.headers()[header::ALLOW], "GET, HEAD");
    }

    /// Works offline: no asset loads anything from another origin. (An SVG file must declare
    /// its XML namespace, which is a name, never fetched.)
    #[test]
    fn no_asset_references_another_origin() {
        for asset in ASSETS {
            let text = asset
                .body
                .replace(r#"xmlns="http://www.w3.org/2000/svg""#, "");
            for scheme in ["http://", "https://", "//cdn", "@import"] {
                assert!(
                    !text.contains(scheme),
                    "{} references `{scheme}`",
                    asset.path
                );
            }
        }
    }

    /// No inline script, style or event handler: the CSP would block them.
    #[test]
    fn the_document_has_nothing_inline() {
        let html = ASSETS[0].body;
        assert!(!html.contains("<style"), "inline <style>");
        assert!(!html.contains(" style="), "inline style attribute");
        for (at, _) in html.match_indices(" on") {
            let name: String = html[at + 3..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase())
                .collect();
            let after = html[at + 3 + name.len()..].chars().next();
            assert!(
                name.is_empty() || after != Some('='),
                "inline event handler on{name}"
            );
        }
        for (at, _) in html.match_indices("<script") {
            let tag = &html[at..at + html[at..].find('>').unwrap()];
            assert!(tag.contains(" src="), "inline script: {tag}");
        }
    }

    /// Every module the application imports is served.
    #[test]
    fn every_imported_module_is_an_asset() {
        for asset in ASSETS.iter().filter(|a| a.path.ends_with(".js")) {
            for line in asset.body.lines() {
                let line = line.trim();
                if !(line.starts_with("import ") || line.starts_with("} from ")) {
                    continue;
                }
                if let Some(start) = line.find("\"./") {
                    let rest = &line[start + 3..];
                    let name = &rest[..rest.find('"').unwrap()];
                    assert!(
                        ASSETS.iter().any(|a| a.path == name),
                        "{} imports {name}, which is not served",
                        asset.path
                    );
                }
            }
        }
    }
}
