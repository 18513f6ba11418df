//! The named presets: per provider, how its requests are signed (a `Scheme`) and where its
//! delivery id, event name and timestamp are (a `Mapping`). docs/webhooks.md
//! documents this table; keep them together.

use super::verify::{Algorithm, Encoding, Part, Scheme, TimeFormat, TimestampSpec};

/// Where a value of the event comes from: a request header or a field of the JSON body
/// (a dotted path, `event.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    Header(&'static str),
    Json(&'static str),
}

/// How a provider's request becomes a CloudEvent.
#[derive(Debug, Clone, Copy)]
pub struct Mapping {
    /// The delivery id: the first source present.
    pub id: &'static [Src],
    /// The event name: the first alternative whose first source is present, with
    /// `.{second}` appended when the second one is present too (GitHub `push`,
    /// `issues.opened`).
    pub kind: &'static [(Src, Option<Src>)],
    pub time: Option<(Src, TimeFormat)>,
    /// The default `type` prefix.
    pub prefix: &'static str,
}

pub const GENERIC: Mapping = Mapping {
    id: &[
        Src::Header("webhook-id"),
        Src::Header("idempotency-key"),
        Src::Header("x-request-id"),
    ],
    kind: &[],
    time: None,
    prefix: "",
};

/// Every named preset, in the order docs/webhooks.md lists them.
pub const NAMES: &[&str] = &[
    "standard-webhooks",
    "svix",
    "github",
    "stripe",
    "slack",
    "shopify",
    "gitlab",
    "twilio",
    "zoom",
    "square",
    "hubspot",
    "linear",
    "intercom",
    "paddle",
    "typeform",
    "calendly",
    "bitbucket",
    "jira",
    "woocommerce",
    "sentry",
    "vercel",
    "twitch",
];

fn hmac(
    header: &str,
    algorithm: Algorithm,
    encoding: Encoding,
    prefix: &str,
    signed: Vec<Part>,
    timestamp: Option<(&str, TimeFormat)>,
) -> Scheme {
    Scheme::Hmac {
        header: header.to_string(),
        algorithm,
        encoding,
        prefix: prefix.to_string(),
        signed,
        timestamp: timestamp.map(|(h, format)| TimestampSpec {
            header: h.to_string(),
            format,
        }),
    }
}

fn body_hmac(header: &str, algorithm: Algorithm, encoding: Encoding, prefix: &str) -> Scheme {
    hmac(header, algorithm, encoding, prefix, vec![Part::Body], None)
}

fn lit(s: &str) -> Part {
    Part::Lit(s.to_string())
}

/// The signature scheme of a named preset.
pub fn scheme(name: &str) -> Option<Scheme> {
    use Algorithm::{Sha1, Sha256};
    use Encoding::{Base64, Hex};
    Some(match name {
        "standard-webhooks" => Scheme::StandardWebhooks { prefix: "webhook" },
        "svix" => Scheme::StandardWebhooks { prefix: "svix" },
        "github" => body_hmac("x-hub-signature-256", Sha256, Hex, "sha256="),
        "stripe" => Scheme::KeyValue {
            header: "stripe-signature",
            pair: ',',
            ts_key: "t",
            sig_key: "v1",
            joiner: ".",
        },
        "calendly" => Scheme::KeyValue {
            header: "calendly-webhook-signature",
            pair: ',',
            ts_key: "t",
            sig_key: "v1",
            joiner: ".",
        },
        "paddle" => Scheme::KeyValue {
            header: "paddle-signature",
            pair: ';',
            ts_key: "ts",
            sig_key: "h1",
            joiner: ":",
        },
        "slack" => hmac(
            "x-slack-signature",
            Sha256,
            Hex,
            "v0=",
            vec![lit("v0:"), Part::Timestamp, lit(":"), Part::Body],
            Some(("x-slack-request-timestamp", TimeFormat::UnixSeconds)),
        ),
        "zoom" => hmac(
            "x-zm-signature",
            Sha256,
            Hex,
            "v0=",
            vec![lit("v0:"), Part::Timestamp, lit(":"), Part::Body],
            Some(("x-zm-request-timestamp", TimeFormat::UnixSeconds)),
        ),
        "shopify" => body_hmac("x-shopify-hmac-sha256", Sha256, Base64, ""),
        "gitlab" => Scheme::Token {
            header: "x-gitlab-token".to_string(),
            prefix: String::new(),
        },
        "twilio" => Scheme::Twilio,
        "square" => hmac(
            "x-square-hmacsha256-signature",
            Sha256,
            Base64,
            "",
            vec![Part::Url, Part::Body],
            None,
        ),
        "hubspot" => hmac(
            "x-hubspot-signature-v3",
            Sha256,
            Base64,
            "",
            vec![Part::Method, Part::Url, Part::Body, Part::Timestamp],
            Some(("x-hubspot-request-timestamp", TimeFormat::UnixMillis)),
        ),
        "linear" => body_hmac("linear-signature", Sha256, Hex, ""),
        "intercom" => body_hmac("x-hub-signature", Sha1, Hex, "sha1="),
        "typeform" => body_hmac("typeform-signature", Sha256, Base64, "sha256="),
        "bitbucket" | "jira" => body_hmac("x-hub-signature", Sha256, Hex, "sha256="),
        "woocommerce" => body_hmac("x-wc-webhook-signature", Sha256, Base64, ""),
        "sentry" => body_hmac("sentry-hook-signature", Sha256, Hex, ""),
        "vercel" => body_hmac("x-vercel-signature", Sha1, Hex, ""),
        "twitch" => hmac(
            "twitch-eventsub-message-signature",
            Sha256,
            Hex,
            "sha256=",
            vec![
                Part::Header("twitch-eventsub-message-id".to_string()),
                Part::Timestamp,
                Part::Body,
            ],
            Some(("twitch-eventsub-message-timestamp", TimeFormat::Rfc3339)),
        ),
        _ => return None,
    })
}

/// Where a named preset's event attributes come from.
pub fn mapping(name: &str) -> Mapping {
    use Src::{Header as H, Json as J};
    use TimeFormat::{Rfc3339, UnixMillis, UnixSeconds};
    match name {
        "standard-webhooks" => Mapping {
            id: &[H("webhook-id")],
            kind: &[(J("type"), None)],
            time: Some((H("webhook-timestamp"), UnixSeconds)),
            prefix: "",
        },
        "svix" => Mapping {
            id: &[H("svix-id")],
            kind: &[(J("type"), None)],
            time: Some((H("svix-timestamp"), UnixSeconds)),
            prefix: "",
        },
        "github" => Mapping {
            id: &[H("x-github-delivery")],
            kind: &[(H("x-github-event"), Some(J("action")))],
            time: None,
            prefix: "com.github.",
        },
        "stripe" => Mapping {
            id: &[J("id")],
            kind: &[(J("type"), None)],
            time: Some((J("created"), UnixSeconds)),
            prefix: "com.stripe.",
        },
        "slack" => Mapping {
            id: &[J("event_id")],
            kind: &[(J("event.type"), None), (J("type"), None)],
            time: Some((J("event_time"), UnixSeconds)),
            prefix: "com.slack.",
        },
        "zoom" => Mapping {
            id: &[],
            kind: &[(J("event"), None)],
            time: Some((J("event_ts"), UnixMillis)),
            prefix: "us.zoom.",
        },
        "shopify" => Mapping {
            id: &[H("x-shopify-webhook-id"), H("x-shopify-event-id")],
            kind: &[(H("x-shopify-topic"), None)],
            time: Some((H("x-shopify-triggered-at"), Rfc3339)),
            prefix: "com.shopify.",
        },
        "gitlab" => Mapping {
            id: &[H("x-gitlab-event-uuid"), H("idempotency-key")],
            kind: &[(J("object_kind"), None)],
            time: None,
            prefix: "com.gitlab.",
        },
        "twilio" => Mapping {
            id: &[H("i-twilio-idempotency-token")],
            kind: &[],
            time: None,
            prefix: "com.twilio.",
        },
        "square" => Mapping {
            id: &[J("event_id")],
            kind: &[(J("type"), None)],
            time: Some((J("created_at"), Rfc3339)),
            prefix: "com.squareup.",
        },
        "hubspot" => Mapping {
            id: &[J("eventId")],
            kind: &[(J("subscriptionType"), None)],
            time: Some((J("occurredAt"), UnixMillis)),
            prefix: "com.hubspot.",
        },
        "linear" => Mapping {
            id: &[H("linear-delivery")],
            kind: &[(H("linear-event"), Some(J("action")))],
            time: Some((J("webhookTimestamp"), UnixMillis)),
            prefix: "app.linear.",
        },
        "intercom" => Mapping {
            id: &[J("id")],
            kind: &[(J("topic"), None)],
            time: Some((J("created_at"), UnixSeconds)),
            prefix: "com.intercom.",
        },
        "paddle" => Mapping {
            id: &[J("event_id")],
            kind: &[(J("event_type"), None)],
            time: Some((J("occurred_at"), Rfc3339)),
            prefix: "com.paddle.",
        },
        "typeform" => Mapping {
            id: &[J("event_id")],
            kind: &[(J("event_type"), None)],
            time: None,
            prefix: "com.typeform.",
        },
        "calendly" => Mapping {
            id: &[],
            kind: &[(J("event"), None)],
            time: Some((J("created_at"), Rfc3339)),
            prefix: "com.calendly.",
        },
        "bitbucket" => Mapping {
            id: &[H("x-request-uuid"), H("x-hook-uuid")],
            kind: &[(H("x-event-key"), None)],
            time: None,
            prefix: "org.bitbucket.",
        },
        "jira" => Mapping {
            id: &[H("x-atlassian-webhook-identifier")],
            kind: &[(J("webhookEvent"), None)],
            time: Some((J("timestamp"), UnixMillis)),
            prefix: "com.atlassian.jira.",
        },
        "woocommerce" => Mapping {
            id: &[H("x-wc-webhook-delivery-id")],
            kind: &[(H("x-wc-webhook-topic"), None)],
            time: None,
            prefix: "com.woocommerce.",
        },
        "sentry" => Mapping {
            id: &[H("request-id")],
            kind: &[(H("sentry-hook-resource"), Some(J("action")))],
            time: Some((H("sentry-hook-timestamp"), UnixSeconds)),
            prefix: "io.sentry.",
        },
        "vercel" => Mapping {
            id: &[J("id")],
            kind: &[(J("type"), None)],
            time: Some((J("createdAt"), UnixMillis)),
            prefix: "com.vercel.",
        },
        "twitch" => Mapping {
            id: &[H("twitch-eventsub-message-id")],
            kind: &[(H("twitch-eventsub-subscription-type"), None)],
            time: Some((H("twitch-eventsub-message-timestamp"), Rfc3339)),
            prefix: "tv.twitch.",
        },
        _ => GENERIC,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_preset_has_a_scheme() {
        assert!(NAMES.len() >= 15);
        for name in NAMES {
            assert!(scheme(name).is_some(), "{name}");
        }
    }
}
