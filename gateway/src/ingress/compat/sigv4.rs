//! AWS Signature Version 4 verification (header form, `Authorization: AWS4-HMAC-SHA256 …`)
//! for the AWS-compatible ingress: the canonical request, the string to sign and the
//! signing key exactly as the AWS SigV4 documentation builds them, so any AWS SDK's
//! signature verifies here with the same secret. Query-string (presigned) signatures and
//! SigV4a (`AWS4-ECDSA-P256-SHA256`) are refused, each with its own reason.

use std::fmt::Write as _;

use hmac::{KeyInit, Mac};
use http::HeaderMap;
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;

/// The only algorithm verified here.
pub const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// SigV4a, which the SDKs use for multi-region endpoints (`EndpointId`): not verified.
pub const ALGORITHM_V4A: &str = "AWS4-ECDSA-P256-SHA256";
/// How far the request's `X-Amz-Date` may be from this replica's clock, as AWS allows.
pub const MAX_SKEW_SECONDS: i64 = 15 * 60;

/// Why a signature was not accepted; each maps to the error AWS answers for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigError {
    /// No `Authorization` header (or a presigned query signature).
    #[error("{0}")]
    Missing(String),
    /// The header is there but not a complete SigV4 authorization.
    #[error("{0}")]
    Incomplete(String),
    /// Signed with SigV4a: this gateway verifies SigV4 only.
    #[error("SigV4a ({ALGORITHM_V4A}) signatures are not supported here: sign with SigV4 ({ALGORITHM}), i.e. do not set EndpointId")]
    Sigv4a,
    /// The access key id is not one the bus accepts.
    #[error("The security token included in the request is invalid.")]
    UnknownKey,
    /// The signature does not match (wrong secret, altered request, skewed clock, ...).
    #[error("{0}")]
    Invalid(String),
}

/// The parsed `Authorization` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    pub access_key: String,
    pub date: String,
    pub region: String,
    pub service: String,
    pub signed_headers: Vec<String>,
    pub signature: String,
}

impl Authorization {
    /// `date/region/service/aws4_request`.
    pub fn scope(&self) -> String {
        format!(
            "{}/{}/{}/aws4_request",
            self.date, self.region, self.service
        )
    }
}

/// Parses `AWS4-HMAC-SHA256 Credential=AKID/20150830/us-east-1/events/aws4_request,
/// SignedHeaders=host;x-amz-date, Signature=hex`.
pub fn parse_authorization(value: &str) -> Result<Authorization, SigError> {
    let value = value.trim();
    let (algorithm, rest) = value.split_once(' ').unwrap_or((value, ""));
    if algorithm == ALGORITHM_V4A {
        return Err(SigError::Sigv4a);
    }
    if algorithm != ALGORITHM {
        return Err(SigError::Incomplete(format!(
            "Authorization header requires the {ALGORITHM} algorithm, got `{}`",
            truncate(algorithm, 40)
        )));
    }
    let (mut credential, mut signed, mut signature) = (None, None, None);
    for part in rest.split(',') {
        let Some((key, val)) = part.trim().split_once('=') else {
            continue;
        };
        match key.trim() {
            "Credential" => credential = Some(val.trim()),
            "SignedHeaders" => signed = Some(val.trim()),
            "Signature" => signature = Some(val.trim()),
            _ => {}
        }
    }
    let missing = |what: &str| {
        SigError::Incomplete(format!(
            "Authorization header requires '{what}' parameter. Authorization={}",
            truncate(value, 200)
        ))
    };
    let credential = credential.ok_or_else(|| missing("Credential"))?;
    let signed = signed.ok_or_else(|| missing("SignedHeaders"))?;
    let signature = signature.ok_or_else(|| missing("Signature"))?;
    let parts: Vec<&str> = credential.split('/').collect();
    let [access_key, date, region, service, terminator] = parts.as_slice() else {
        return Err(SigError::Incomplete(
            "Credential must have exactly 5 slash-delimited elements, e.g. keyid/date/region/service/aws4_request".to_string(),
        ));
    };
    if *terminator != "aws4_request" || access_key.is_empty() {
        return Err(SigError::Incomplete(
            "Credential must end in `aws4_request` and start with an access key id".to_string(),
        ));
    }
    if date.len() != 8 || !date.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SigError::Incomplete(
            "the Credential's date must be 8 digits (yyyymmdd)".to_string(),
        ));
    }
    let signed_headers: Vec<String> = signed
        .split(';')
        .map(|h| h.trim().to_ascii_lowercase())
        .collect();
    if signed_headers.iter().any(String::is_empty) || !signed_headers.iter().any(|h| h == "host") {
        return Err(SigError::Incomplete(
            "SignedHeaders must name `host` and no empty header".to_string(),
        ));
    }
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(SigError::Incomplete(
            "Signature must be 64 hex digits".to_string(),
        ));
    }
    Ok(Authorization {
        access_key: (*access_key).to_string(),
        date: (*date).to_string(),
        region: (*region).to_string(),
        service: (*service).to_string(),
        signed_headers,
        signature: signature.to_ascii_lowercase(),
    })
}

fn truncate(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&sha2::Sha256::digest(bytes))
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length: `new_from_slice` cannot fail.
    match <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key) {
        Ok(mut mac) => {
            mac.update(data);
            mac.finalize().into_bytes().into()
        }
        Err(_) => [0; 32],
    }
}

/// `kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service), "aws4_request")`.
pub fn signing_key(secret: &str, date: &str, region: &str, service: &str) -> [u8; 32] {
    let k_date = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    let k_region = hmac(&k_date, region.as_bytes());
    let k_service = hmac(&k_region, service.as_bytes());
    hmac(&k_service, b"aws4_request")
}

/// Percent-encodes as SigV4 wants: every byte but `A-Za-z0-9-_.~` (and `/` when
/// `keep_slash`), upper-case hex.
fn uri_encode(bytes: &[u8], keep_slash: bool) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn percent_decode(text: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(text).collect()
}

/// The canonical URI: the path with dot segments removed, its segments URI-encoded (the
/// path as sent is encoded once more, as every service but S3 does).
pub fn canonical_uri(path: &str) -> String {
    let mut segments: Vec<&str> = Vec::new();
    let ends_with_slash = path.ends_with('/') && path.len() > 1;
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut normalized = format!("/{}", segments.join("/"));
    if ends_with_slash && normalized != "/" {
        normalized.push('/');
    }
    uri_encode(normalized.as_bytes(), true)
}

/// The canonical query string: parameters decoded, re-encoded, sorted by name then value.
pub fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (
                uri_encode(&percent_decode(k), false),
                uri_encode(&percent_decode(v), false),
            )
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// A header's values as the canonical request has them: trimmed, inner runs of spaces
/// made one, several values joined by `,`.
fn canonical_header_value(headers: &HeaderMap, name: &str) -> Option<String> {
    let mut values = headers.get_all(name).iter().peekable();
    values.peek()?;
    let joined: Vec<String> = values
        .map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    Some(joined.join(","))
}

/// The canonical request (`method\nuri\nquery\nheaders\n\nsigned\npayload-hash`). `host`
/// falls back to `authority` (HTTP/2) when the request has no `Host` header. A signed
/// header the request lacks is an error.
pub fn canonical_request(
    method: &str,
    path: &str,
    query: &str,
    headers: &HeaderMap,
    authority: Option<&str>,
    signed_headers: &[String],
    payload_hash: &str,
) -> Result<String, SigError> {
    let mut sorted = signed_headers.to_vec();
    sorted.sort();
    sorted.dedup();
    let mut canonical_headers = String::new();
    for name in &sorted {
        let value = match canonical_header_value(headers, name) {
            Some(v) => v,
            None if name == "host" => authority.map(str::to_string).ok_or_else(|| {
                SigError::Invalid("the signed header `host` is missing".to_string())
            })?,
            None => {
                return Err(SigError::Invalid(format!(
                    "the signed header `{}` is missing from the request",
                    truncate(name, 64)
                )))
            }
        };
        let _ = writeln!(canonical_headers, "{name}:{value}");
    }
    Ok(format!(
        "{method}\n{}\n{}\n{canonical_headers}\n{}\n{payload_hash}",
        canonical_uri(path),
        canonical_query(query),
        sorted.join(";"),
    ))
}

pub fn string_to_sign(amz_date: &str, scope: &str, canonical_request: &str) -> String {
    format!(
        "{ALGORITHM}\n{amz_date}\n{scope}\n{}",
        sha256_hex(canonical_request.as_bytes())
    )
}

/// The hex signature of a canonical request.
pub fn sign(secret: &str, auth: &Authorization, amz_date: &str, canonical: &str) -> String {
    let key = signing_key(secret, &auth.date, &auth.region, &auth.service);
    hex(&hmac(
        &key,
        string_to_sign(amz_date, &auth.scope(), canonical).as_bytes(),
    ))
}

/// Parses `yyyymmddThhmmssZ` into seconds since the epoch.
pub fn parse_amz_date(text: &str) -> Option<i64> {
    chrono::NaiveDateTime::parse_from_str(text, "%Y%m%dT%H%M%SZ")
        .ok()
        .map(|t| t.and_utc().timestamp())
}

/// A request as the verifier needs it.
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    pub authority: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// Verifies a request's SigV4 signature for `service`, with `secret_of` giving the secret
/// of an accepted access key id; `now` in seconds since the epoch. Returns the access key
/// id that signed it.
pub fn verify(
    request: &Request<'_>,
    service: &str,
    now: i64,
    secret_of: &dyn Fn(&str) -> Option<String>,
) -> Result<String, SigError> {
    let Some(header) = request.headers.get(http::header::AUTHORIZATION) else {
        return Err(SigError::Missing(
            "Missing Authentication Token: sign the request with SigV4 (an `Authorization: AWS4-HMAC-SHA256 ...` header)".to_string(),
        ));
    };
    let header = header
        .to_str()
        .map_err(|_| SigError::Incomplete("the Authorization header is not ASCII".to_string()))?;
    let auth = parse_authorization(header)?;
    let amz_date = request
        .headers
        .get("x-amz-date")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            SigError::Incomplete("the signed request must carry an X-Amz-Date header".to_string())
        })?;
    let signed_at = parse_amz_date(amz_date).ok_or_else(|| {
        SigError::Incomplete(format!(
            "X-Amz-Date `{}` is not of the form yyyymmddThhmmssZ",
            truncate(amz_date, 40)
        ))
    })?;
    if !amz_date.starts_with(&auth.date) {
        return Err(SigError::Invalid(format!(
            "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: '{}' != '{}'",
            auth.date,
            truncate(amz_date, 8)
        )));
    }
    if auth.service != service {
        return Err(SigError::Invalid(format!(
            "Credential should be scoped to correct service: '{service}'."
        )));
    }
    let secret = secret_of(&auth.access_key).ok_or(SigError::UnknownKey)?;
    if (now - signed_at).abs() > MAX_SKEW_SECONDS {
        return Err(SigError::Invalid(format!(
            "Signature expired: {amz_date} is more than 15 minutes from the server's time ({})",
            chrono::DateTime::from_timestamp(now, 0)
                .map(|t| t.format("%Y%m%dT%H%M%SZ").to_string())
                .unwrap_or_default()
        )));
    }
    let body_hash = sha256_hex(request.body);
    let payload_hash = match request
        .headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
    {
        // An event's body must be signed: an unsigned payload could be anything.
        Some("UNSIGNED-PAYLOAD") => {
            return Err(SigError::Invalid(
                "UNSIGNED-PAYLOAD is not accepted: the body must be signed".to_string(),
            ))
        }
        Some(declared) if !declared.eq_ignore_ascii_case(&body_hash) => {
            return Err(SigError::Invalid(
                "The provided 'x-amz-content-sha256' header does not match what was computed."
                    .to_string(),
            ))
        }
        Some(declared) => declared.to_string(),
        None => body_hash,
    };
    let canonical = canonical_request(
        request.method,
        request.path,
        request.query,
        request.headers,
        request.authority,
        &auth.signed_headers,
        &payload_hash,
    )?;
    let expected = sign(&secret, &auth, amz_date, &canonical);
    if bool::from(expected.as_bytes().ct_eq(auth.signature.as_bytes())) {
        Ok(auth.access_key)
    } else {
        Err(SigError::Invalid(
            "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.".to_string(),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    // The AWS SigV4 test suite's credentials and date (`aws-sig-v4-test-suite`, also in
    // the SigV4 documentation): `AKIDEXAMPLE`, this secret, 20150830T123600Z, us-east-1,
    // service `service`.
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    const DATE: &str = "20150830T123600Z";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn auth_header(signed: &str, signature: &str) -> String {
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders={signed}, Signature={signature}")
    }

    // One argument per column of the test suite's table.
    #[allow(clippy::too_many_arguments)]
    fn check(
        method: &str,
        path: &str,
        query: &str,
        extra: &[(&str, &str)],
        signed: &str,
        body: &[u8],
        canonical_want: &str,
        signature: &str,
    ) {
        let mut pairs = vec![("host", "example.amazonaws.com"), ("x-amz-date", DATE)];
        pairs.extend_from_slice(extra);
        let mut h = headers(&pairs);
        let auth = parse_authorization(&auth_header(signed, signature)).unwrap();
        let canonical = canonical_request(
            method,
            path,
            query,
            &h,
            None,
            &auth.signed_headers,
            &sha256_hex(body),
        )
        .unwrap();
        assert_eq!(canonical, canonical_want);
        assert_eq!(sign(SECRET, &auth, DATE, &canonical), signature);
        h.insert(
            http::header::AUTHORIZATION,
            auth_header(signed, signature).parse().unwrap(),
        );
        let now = parse_amz_date(DATE).unwrap() + 60;
        let request = Request {
            method,
            path,
            query,
            authority: None,
            headers: &h,
            body,
        };
        let secrets = |id: &str| (id == "AKIDEXAMPLE").then(|| SECRET.to_string());
        assert_eq!(
            verify(&request, "service", now, &secrets).unwrap(),
            "AKIDEXAMPLE"
        );
        // The wrong secret, another key, a skewed clock, another service: refused.
        let wrong = |_: &str| Some("not-the-secret".to_string());
        assert!(matches!(
            verify(&request, "service", now, &wrong),
            Err(SigError::Invalid(_))
        ));
        assert_eq!(
            verify(&request, "service", now, &|_| None),
            Err(SigError::UnknownKey)
        );
        let late = verify(&request, "service", now + 16 * 60, &secrets).unwrap_err();
        assert!(late.to_string().starts_with("Signature expired"), "{late}");
        assert!(verify(&request, "events", now, &secrets).is_err());
        // Another body under the same signature: refused.
        let altered = Request {
            body: b"tampered",
            ..request
        };
        assert!(matches!(
            verify(&altered, "service", now, &secrets),
            Err(SigError::Invalid(_))
        ));
    }

    #[test]
    fn get_vanilla() {
        check(
            "GET",
            "/",
            "",
            &[],
            "host;x-amz-date",
            b"",
            "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31",
        );
    }

    #[test]
    fn get_vanilla_query_order_key_case() {
        check(
            "GET",
            "/",
            "Param2=value2&Param1=value1",
            &[],
            "host;x-amz-date",
            b"",
            "GET\n/\nParam1=value1&Param2=value2\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500",
        );
    }

    #[test]
    fn post_x_www_form_urlencoded() {
        check(
            "POST",
            "/",
            "",
            &[("content-type", "application/x-www-form-urlencoded")],
            "content-type;host;x-amz-date",
            b"Param1=value1",
            "POST\n/\n\ncontent-type:application/x-www-form-urlencoded\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\ncontent-type;host;x-amz-date\n9095672bbd1f56dfc5b65f3e153adc8731a4a654192329106275f4c7b24d0b6e",
            "ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a",
        );
    }

    #[test]
    fn parses_and_refuses_authorizations() {
        assert_eq!(
            parse_authorization("AWS4-ECDSA-P256-SHA256 Credential=x/20150830/events/aws4_request, SignedHeaders=host, Signature=00"),
            Err(SigError::Sigv4a)
        );
        for bad in [
            "Bearer x",
            "AWS4-HMAC-SHA256",
            "AWS4-HMAC-SHA256 Credential=AK/2015/us-east-1/events/aws4_request, SignedHeaders=host, Signature=aa",
            "AWS4-HMAC-SHA256 Credential=AK/20150830/us-east-1/events, SignedHeaders=host, Signature=aa",
            "AWS4-HMAC-SHA256 Credential=AK/20150830/us-east-1/events/aws4_request, SignedHeaders=x-amz-date, Signature=aa",
        ] {
            assert!(
                matches!(parse_authorization(bad), Err(SigError::Incomplete(_))),
                "{bad}"
            );
        }
        assert_eq!(canonical_uri("/a/./b/../c//d/"), "/a/c/d/");
        assert_eq!(canonical_uri("/a%20b"), "/a%2520b");
        assert_eq!(canonical_uri(""), "/");
        assert_eq!(canonical_query("b=2&a=%20x&a=1"), "a=%20x&a=1&b=2");
    }
}
