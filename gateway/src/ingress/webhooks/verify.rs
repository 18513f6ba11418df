//! Signature schemes of webhook providers: pure, synchronous checks of one request (method,
//! public URL, headers, body, the current time) against one or more secrets.
//!
//! Most providers sign with an HMAC over some concatenation of the body, a timestamp and
//! ids; they differ in the header, the hash, the encoding and what is signed. `Scheme::Hmac`
//! covers them all with a template of `Part`s, so a preset is a table entry, not code.
//! The few that carry several fields in one header (Stripe `t=..,v1=..`), that sign form
//! parameters (Twilio) or compare a shared token are schemes of their own.

use base64::Engine;
use hmac::{KeyInit, Mac};
use http::HeaderMap;
use subtle::ConstantTimeEq;

/// Why a request was refused: the header (or setting) at fault and what was wrong. The
/// message never contains a secret or an expected signature.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct VerifyError {
    pub field: String,
    pub message: String,
}

fn err(field: &str, message: impl Into<String>) -> VerifyError {
    VerifyError {
        field: field.to_string(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Sha1,
    Sha256,
    Sha512,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Hex,
    Base64,
}

/// How a timestamp is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeFormat {
    UnixSeconds,
    UnixMillis,
    Rfc3339,
}

impl TimeFormat {
    /// Unix seconds of a timestamp written in this format.
    pub fn parse(self, text: &str) -> Option<i64> {
        let text = text.trim();
        match self {
            TimeFormat::UnixSeconds => text.parse::<i64>().ok(),
            TimeFormat::UnixMillis => text.parse::<i64>().ok().map(|ms| ms.div_euclid(1000)),
            TimeFormat::Rfc3339 => chrono::DateTime::parse_from_rfc3339(text)
                .ok()
                .map(|t| t.timestamp()),
        }
    }
}

/// One piece of what an HMAC scheme signs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Lit(String),
    Body,
    /// A request header's value (missing: the request is refused).
    Header(String),
    /// The scheme's timestamp, as written in its header.
    Timestamp,
    /// The public URL of the endpoint (the `url` setting).
    Url,
    Method,
}

/// Parses a signing template: `{body}`, `{timestamp}`, `{url}`, `{method}`,
/// `{header:NAME}` and literal text.
pub fn parse_template(text: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        if open > 0 {
            parts.push(Part::Lit(rest[..open].to_string()));
        }
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err(format!("`{text}`: unclosed `{{`"));
        };
        let name = &after[..close];
        parts.push(match name {
            "body" => Part::Body,
            "timestamp" => Part::Timestamp,
            "url" => Part::Url,
            "method" => Part::Method,
            _ => match name.strip_prefix("header:") {
                Some(h) if http::HeaderName::from_bytes(h.as_bytes()).is_ok() => {
                    Part::Header(h.to_ascii_lowercase())
                }
                _ => {
                    return Err(format!(
                        "`{text}`: unknown placeholder `{{{name}}}` (body, timestamp, url, method, header:NAME)"
                    ))
                }
            },
        });
        rest = &after[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Lit(rest.to_string()));
    }
    if !parts.contains(&Part::Body) {
        return Err(format!("`{text}` does not sign `{{body}}`"));
    }
    Ok(parts)
}

/// Where a scheme's timestamp is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimestampSpec {
    pub header: String,
    pub format: TimeFormat,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheme {
    /// No verification (`preset = "none"`): for trusted networks only.
    None,
    /// Standard Webhooks (and Svix, with `svix-` headers): `v1,<base64>` signatures over
    /// `{id}.{timestamp}.{body}`, keys `whsec_<base64>`.
    StandardWebhooks { prefix: &'static str },
    /// An HMAC of `signed` in `header`, after `prefix`; `separator` splits several
    /// signatures in one header.
    Hmac {
        header: String,
        algorithm: Algorithm,
        encoding: Encoding,
        prefix: String,
        signed: Vec<Part>,
        timestamp: Option<TimestampSpec>,
    },
    /// `t=<unix>,v1=<hex>[,v1=<hex>]` (Stripe, Calendly; Paddle with `;`, `ts`, `h1`):
    /// hex HMAC-SHA256 of `{t}{joiner}{body}`.
    KeyValue {
        header: &'static str,
        pair: char,
        ts_key: &'static str,
        sig_key: &'static str,
        joiner: &'static str,
    },
    /// Twilio: base64 HMAC-SHA1 of the URL and, for a form body, each parameter's name and
    /// value sorted by name; a JSON body is covered by `bodySHA256` in the URL's query.
    Twilio,
    /// A shared token in a header, compared as is (GitLab `X-Gitlab-Token`, API keys);
    /// `prefix` (`Bearer `) is stripped first.
    Token { header: String, prefix: String },
    /// HTTP Basic authentication: the secrets are `user:password`.
    Basic,
}

/// A request as the verifier sees it.
pub struct Signed<'a> {
    pub method: &'a str,
    /// The endpoint's public URL (with the query string the provider called).
    pub url: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    /// Unix seconds.
    pub now: i64,
}

/// One secret, as bytes ready for the MAC.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A Standard Webhooks key: `whsec_` + base64 (the base64 is the key); other text is used
/// as is (what the reference libraries do with raw keys).
pub fn standard_webhooks_key(secret: &str) -> Result<Secret, String> {
    match secret.strip_prefix("whsec_") {
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map(Secret)
            .map_err(|_| "a `whsec_` secret must be followed by base64".to_string()),
        None => Ok(Secret(secret.as_bytes().to_vec())),
    }
}

pub fn hmac(algorithm: Algorithm, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    fn run<M: Mac + KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        // HMAC takes keys of any length: this cannot fail.
        match <M as KeyInit>::new_from_slice(key) {
            Ok(mut mac) => {
                for p in parts {
                    mac.update(p);
                }
                mac.finalize().into_bytes().to_vec()
            }
            Err(_) => Vec::new(),
        }
    }
    match algorithm {
        Algorithm::Sha1 => run::<hmac::Hmac<sha1::Sha1>>(key, parts),
        Algorithm::Sha256 => run::<hmac::Hmac<sha2::Sha256>>(key, parts),
        Algorithm::Sha512 => run::<hmac::Hmac<sha2::Sha512>>(key, parts),
    }
}

pub fn encode(encoding: Encoding, bytes: &[u8]) -> String {
    match encoding {
        Encoding::Hex => hex(bytes),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Constant-time equality of two signatures as written (hex compared without case).
fn same(expected: &str, given: &str, encoding: Encoding) -> bool {
    match encoding {
        Encoding::Hex => expected
            .as_bytes()
            .ct_eq(given.to_ascii_lowercase().as_bytes())
            .into(),
        Encoding::Base64 => expected.as_bytes().ct_eq(given.as_bytes()).into(),
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, VerifyError> {
    match headers.get(name) {
        None => Err(err(name, "the header is missing")),
        Some(v) => v
            .to_str()
            .map(str::trim)
            .map_err(|_| err(name, "the header is not ASCII text")),
    }
}

fn check_time(field: &str, at: i64, now: i64, tolerance: i64) -> Result<(), VerifyError> {
    // `abs_diff` cannot overflow, whatever the sender wrote (`i64::MIN` included).
    let away = now.abs_diff(at);
    if away > tolerance.unsigned_abs() {
        return Err(err(
            field,
            format!("the timestamp is {away} s away from now; at most {tolerance} s are accepted"),
        ));
    }
    Ok(())
}

impl Scheme {
    /// Whether the scheme signs a timestamp (so `tolerance` applies).
    pub fn has_timestamp(&self) -> bool {
        match self {
            Scheme::StandardWebhooks { .. } | Scheme::KeyValue { .. } => true,
            Scheme::Hmac { timestamp, .. } => timestamp.is_some(),
            _ => false,
        }
    }

    /// Whether the scheme signs the public URL (so `url` must be configured).
    pub fn needs_url(&self) -> bool {
        match self {
            Scheme::Twilio => true,
            Scheme::Hmac { signed, .. } => signed.contains(&Part::Url),
            _ => false,
        }
    }

    /// Checks a request against every secret (rotation: any one may match).
    pub fn verify(
        &self,
        request: &Signed<'_>,
        secrets: &[Secret],
        tolerance: i64,
    ) -> Result<(), VerifyError> {
        match self {
            Scheme::None => Ok(()),
            Scheme::StandardWebhooks { prefix } => {
                standard_webhooks(prefix, request, secrets, tolerance)
            }
            Scheme::Hmac {
                header: name,
                algorithm,
                encoding,
                prefix,
                signed,
                timestamp,
            } => {
                let given = header(request.headers, name)?;
                let ts = match timestamp {
                    Some(spec) => {
                        let text = header(request.headers, &spec.header)?;
                        let at = spec
                            .format
                            .parse(text)
                            .ok_or_else(|| err(&spec.header, "not a valid timestamp"))?;
                        check_time(&spec.header, at, request.now, tolerance)?;
                        Some(text)
                    }
                    None => None,
                };
                let mut pieces: Vec<&[u8]> = Vec::with_capacity(signed.len());
                for part in signed {
                    pieces.push(match part {
                        Part::Lit(s) => s.as_bytes(),
                        Part::Body => request.body,
                        Part::Header(h) => header(request.headers, h)?.as_bytes(),
                        Part::Timestamp => ts.unwrap_or_default().as_bytes(),
                        Part::Url => request.url.as_bytes(),
                        Part::Method => request.method.as_bytes(),
                    });
                }
                let Some(given) = given.strip_prefix(prefix.as_str()) else {
                    return Err(err(
                        name,
                        format!("the signature does not start with `{prefix}`"),
                    ));
                };
                for secret in secrets {
                    let expected = encode(*encoding, &hmac(*algorithm, secret.bytes(), &pieces));
                    if same(&expected, given.trim(), *encoding) {
                        return Ok(());
                    }
                }
                Err(err(name, "the signature does not match"))
            }
            Scheme::KeyValue {
                header: name,
                pair,
                ts_key,
                sig_key,
                joiner,
            } => {
                let value = header(request.headers, name)?;
                let mut ts = None;
                let mut given = Vec::new();
                for item in value.split(*pair) {
                    let Some((k, v)) = item.trim().split_once('=') else {
                        continue;
                    };
                    if k == *ts_key {
                        ts = Some(v);
                    } else if k == *sig_key {
                        given.push(v);
                    }
                }
                let ts = ts.ok_or_else(|| err(name, format!("no `{ts_key}=` timestamp")))?;
                if given.is_empty() {
                    return Err(err(name, format!("no `{sig_key}=` signature")));
                }
                let at = TimeFormat::UnixSeconds
                    .parse(ts)
                    .ok_or_else(|| err(name, "the timestamp is not a number"))?;
                check_time(name, at, request.now, tolerance)?;
                for secret in secrets {
                    let expected = hex(&hmac(
                        Algorithm::Sha256,
                        secret.bytes(),
                        &[ts.as_bytes(), joiner.as_bytes(), request.body],
                    ));
                    if given.iter().any(|g| same(&expected, g, Encoding::Hex)) {
                        return Ok(());
                    }
                }
                Err(err(name, "no signature matches"))
            }
            Scheme::Twilio => twilio(request, secrets),
            Scheme::Token {
                header: name,
                prefix,
            } => {
                let given = header(request.headers, name)?;
                let given = given.strip_prefix(prefix.as_str()).unwrap_or(given);
                // Compared as digests: equal lengths, so the time does not tell the length.
                let given = hmac(Algorithm::Sha256, b"sluice", &[given.as_bytes()]);
                for secret in secrets {
                    let expected = hmac(Algorithm::Sha256, b"sluice", &[secret.bytes()]);
                    if bool::from(expected.ct_eq(&given)) {
                        return Ok(());
                    }
                }
                Err(err(name, "the token does not match"))
            }
            Scheme::Basic => {
                let value = header(request.headers, "authorization")?;
                // The scheme name is case-insensitive (RFC 9110 §11.1).
                let b64 = match value.split_once(' ') {
                    Some((scheme, rest)) if scheme.eq_ignore_ascii_case("basic") => rest,
                    _ => return Err(err("authorization", "not `Basic` credentials")),
                };
                let given = base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map_err(|_| err("authorization", "the credentials are not base64"))?;
                let given = hmac(Algorithm::Sha256, b"sluice", &[&given]);
                for secret in secrets {
                    let expected = hmac(Algorithm::Sha256, b"sluice", &[secret.bytes()]);
                    if bool::from(expected.ct_eq(&given)) {
                        return Ok(());
                    }
                }
                Err(err("authorization", "the credentials do not match"))
            }
        }
    }
}

fn standard_webhooks(
    prefix: &str,
    request: &Signed<'_>,
    secrets: &[Secret],
    tolerance: i64,
) -> Result<(), VerifyError> {
    let id_h = format!("{prefix}-id");
    let ts_h = format!("{prefix}-timestamp");
    let sig_h = format!("{prefix}-signature");
    let id = header(request.headers, &id_h)?;
    let ts = header(request.headers, &ts_h)?;
    let signatures = header(request.headers, &sig_h)?;
    let at = TimeFormat::UnixSeconds
        .parse(ts)
        .ok_or_else(|| err(&ts_h, "not a number of seconds"))?;
    check_time(&ts_h, at, request.now, tolerance)?;
    let given: Vec<&str> = signatures
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .collect();
    if given.is_empty() {
        return Err(err(&sig_h, "no `v1,` signature"));
    }
    for secret in secrets {
        let expected = encode(
            Encoding::Base64,
            &hmac(
                Algorithm::Sha256,
                secret.bytes(),
                &[id.as_bytes(), b".", ts.as_bytes(), b".", request.body],
            ),
        );
        if given.iter().any(|g| same(&expected, g, Encoding::Base64)) {
            return Ok(());
        }
    }
    Err(err(&sig_h, "no signature matches"))
}

fn twilio(request: &Signed<'_>, secrets: &[Secret]) -> Result<(), VerifyError> {
    const H: &str = "x-twilio-signature";
    let given = header(request.headers, H)?;
    let url = url::Url::parse(request.url).map_err(|_| err("url", "not a valid URL"))?;
    let body_sha = url
        .query_pairs()
        .find(|(k, _)| k == "bodySHA256")
        .map(|(_, v)| v.into_owned());
    let mut signed = request.url.as_bytes().to_vec();
    match body_sha {
        Some(expected) => {
            // JSON bodies: the URL (with its bodySHA256) is signed, the body is hashed.
            use sha2::Digest;
            let digest = hex(&sha2::Sha256::digest(request.body));
            if !bool::from(digest.as_bytes().ct_eq(expected.as_bytes())) {
                return Err(err("bodySHA256", "the body does not match its hash"));
            }
        }
        None => {
            let is_form = request
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
            if is_form {
                let mut params: Vec<(String, String)> = url::form_urlencoded::parse(request.body)
                    .into_owned()
                    .collect();
                params.sort();
                for (k, v) in params {
                    signed.extend_from_slice(k.as_bytes());
                    signed.extend_from_slice(v.as_bytes());
                }
            }
        }
    }
    for secret in secrets {
        let expected = encode(
            Encoding::Base64,
            &hmac(Algorithm::Sha1, secret.bytes(), &[&signed]),
        );
        if same(&expected, given, Encoding::Base64) {
            return Ok(());
        }
    }
    Err(err(H, "the signature does not match"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn signed<'a>(h: &'a HeaderMap, url: &'a str, body: &'a [u8], now: i64) -> Signed<'a> {
        Signed {
            method: "POST",
            url,
            headers: h,
            body,
            now,
        }
    }

    /// GitHub's documented test vector (docs.github.com, "Validating webhook deliveries").
    #[test]
    fn github_documented_vector() {
        let scheme = crate::ingress::webhooks::presets::scheme("github").unwrap();
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        let secrets = [Secret::new("It's a Secret to Everybody")];
        let ok = scheme.verify(&signed(&h, "", b"Hello, World!", 0), &secrets, 300);
        assert_eq!(ok, Ok(()));
        let bad = scheme.verify(&signed(&h, "", b"Hello, World?", 0), &secrets, 300);
        assert_eq!(bad.unwrap_err().field, "x-hub-signature-256");
    }

    /// Twilio's documented example (twilio.com/docs/usage/security): URL and sorted form
    /// parameters, auth token `12345`.
    #[test]
    fn twilio_documented_vector() {
        let url = "https://mycompany.com/myapp.php?foo=1&bar=2";
        let body = b"CallSid=CA1234567890ABCDE&Caller=%2B12349013030&Digits=1234&From=%2B12349013030&To=%2B18005551212";
        let h = headers(&[
            ("x-twilio-signature", "0/KCTR6DLpKmkAf8muzZqo1nDgQ="),
            ("content-type", "application/x-www-form-urlencoded"),
        ]);
        let secrets = [Secret::new("12345")];
        assert_eq!(
            Scheme::Twilio.verify(&signed(&h, url, body, 0), &secrets, 300),
            Ok(())
        );
        let wrong = [Secret::new("54321")];
        assert!(Scheme::Twilio
            .verify(&signed(&h, url, body, 0), &wrong, 300)
            .is_err());
    }

    /// Slack's documented example (api.slack.com/authentication/verifying-requests-from-slack).
    #[test]
    fn slack_documented_vector() {
        let scheme = crate::ingress::webhooks::presets::scheme("slack").unwrap();
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let h = headers(&[
            ("x-slack-request-timestamp", "1531420618"),
            (
                "x-slack-signature",
                "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
            ),
        ]);
        let secrets = [Secret::new("8f742231b10e8888abcd99yyyzzz85a5")];
        assert_eq!(
            scheme.verify(&signed(&h, "", body, 1_531_420_618), &secrets, 300),
            Ok(())
        );
        let late = scheme.verify(&signed(&h, "", body, 1_531_420_618 + 301), &secrets, 300);
        assert_eq!(late.unwrap_err().field, "x-slack-request-timestamp");
    }

    /// Timestamps at the ends of `i64` are refused as too far away, never overflow (the
    /// difference with now used to panic in debug builds), whatever the tolerance.
    #[test]
    fn extreme_timestamps_are_refused_without_overflow() {
        let cases = [
            ("standard-webhooks", "webhook-timestamp"),
            ("slack", "x-slack-request-timestamp"),
            ("stripe", "stripe-signature"),
        ];
        for (preset, field) in cases {
            let scheme = crate::ingress::webhooks::presets::scheme(preset).unwrap();
            for at in [i64::MIN, i64::MAX, i64::MIN + 1] {
                let value = if preset == "stripe" {
                    format!("t={at},v1=00")
                } else {
                    at.to_string()
                };
                let h = headers(&[
                    (field, value.as_str()),
                    ("webhook-id", "msg_1"),
                    ("webhook-signature", "v1,AAAA"),
                    ("x-slack-signature", "v0=00"),
                ]);
                for (now, tolerance) in [(1_700_000_000, 300), (i64::MIN, 300), (0, i64::MAX)] {
                    let result =
                        scheme.verify(&signed(&h, "", b"{}", now), &[Secret::new("k")], tolerance);
                    assert!(result.is_err(), "{preset} at {at} now {now}");
                }
            }
        }
        assert!(check_time("t", i64::MIN, i64::MAX, 300).is_err());
        assert!(check_time("t", i64::MAX, i64::MIN, i64::MAX).is_err());
        assert!(check_time("t", 100, 400, 300).is_ok());
        assert!(check_time("t", 401, 100, 300).is_err());
    }

    /// The Standard Webhooks specification's example (standard-webhooks/spec).
    #[test]
    fn standard_webhooks_documented_vector() {
        let scheme = crate::ingress::webhooks::presets::scheme("standard-webhooks").unwrap();
        let body = br#"{"test": 2432232314}"#;
        let h = headers(&[
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            (
                "webhook-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ]);
        let key = standard_webhooks_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            scheme.verify(
                &signed(&h, "", body, 1_614_265_330),
                std::slice::from_ref(&key),
                300
            ),
            Ok(())
        );
        // Rotation: the right key among others.
        let other = standard_webhooks_key("whsec_c2VjcmV0").unwrap();
        assert_eq!(
            scheme.verify(
                &signed(&h, "", body, 1_614_265_330),
                &[other.clone(), key],
                300
            ),
            Ok(())
        );
        assert!(scheme
            .verify(&signed(&h, "", body, 1_614_265_330), &[other], 300)
            .is_err());
    }

    #[test]
    fn stripe_style_header_with_several_signatures() {
        let scheme = crate::ingress::webhooks::presets::scheme("stripe").unwrap();
        let body = br#"{"id":"evt_1"}"#;
        let sig = hex(&hmac(Algorithm::Sha256, b"whsec_x", &[b"100.", body]));
        let value = format!("t=100,v1=deadbeef,v1={sig},v0=00");
        let h = headers(&[("stripe-signature", &value)]);
        let s = [Secret::new("whsec_x")];
        assert_eq!(scheme.verify(&signed(&h, "", body, 100), &s, 300), Ok(()));
        assert!(scheme.verify(&signed(&h, "", body, 500), &s, 300).is_err());
        assert!(scheme.verify(&signed(&h, "", b"{}", 100), &s, 300).is_err());
    }

    #[test]
    fn templates_parse() {
        assert_eq!(
            parse_template("v0:{timestamp}:{body}").unwrap(),
            vec![
                Part::Lit("v0:".into()),
                Part::Timestamp,
                Part::Lit(":".into()),
                Part::Body
            ]
        );
        assert!(parse_template("{timestamp}").is_err());
        assert!(parse_template("{nope}{body}").is_err());
        assert!(parse_template("{body").is_err());
    }

    #[test]
    fn tokens_and_basic() {
        let token = Scheme::Token {
            header: "x-gitlab-token".into(),
            prefix: String::new(),
        };
        let h = headers(&[("x-gitlab-token", "s3cret")]);
        let s = [Secret::new("old"), Secret::new("s3cret")];
        assert_eq!(token.verify(&signed(&h, "", b"", 0), &s, 0), Ok(()));
        assert!(token
            .verify(&signed(&h, "", b"", 0), &[Secret::new("s3cre")], 0)
            .is_err());
        let h = headers(&[("authorization", "basic dXNlcjpwdw==")]);
        assert_eq!(
            Scheme::Basic.verify(&signed(&h, "", b"", 0), &[Secret::new("user:pw")], 0),
            Ok(())
        );
        assert!(Scheme::Basic
            .verify(&signed(&h, "", b"", 0), &[Secret::new("user:px")], 0)
            .is_err());
    }
}
