"""Signs a webhook request the way its provider does, for tests/tests/webhooks.rs.

Reads one JSON object on stdin: {"preset", "secret", "body", "timestamp", "id", "url"} and
prints the headers to send as a JSON object. Where the provider publishes a library, the
signature comes from it (Standard Webhooks: `standardwebhooks`; Stripe: `stripe`'s
`WebhookSignature.generate_signature_header`; Slack: `slack_sdk`'s `SignatureVerifier`;
GitHub: `@octokit/webhooks-methods`' `sign`, run with node from $WEBHOOK_NODE_DIR, which
`make webhook-node` fills);
the others follow the provider's documentation with Python's own `hmac`, independently of
the gateway's code.
"""

import base64
import datetime
import hashlib
import hmac
import json
import os
import subprocess
import sys
import urllib.parse


def octokit_sign(secret, body):
    """GitHub's `X-Hub-Signature-256`, made by @octokit/webhooks-methods."""
    where = os.environ.get("WEBHOOK_NODE_DIR") or os.path.expanduser("~/.cache/sluice/webhook-node")
    if not os.path.isdir(os.path.join(where, "node_modules", "@octokit", "webhooks-methods")):
        sys.exit(f"@octokit/webhooks-methods is not installed in {where}: run `make webhook-node`")
    script = (
        'import { sign } from "@octokit/webhooks-methods";'
        'const [secret, body] = JSON.parse(process.argv[1]);'
        'process.stdout.write(await sign(secret, body));'
    )
    out = subprocess.run(
        ["node", "--input-type=module", "-e", script, json.dumps([secret, body])],
        cwd=where, capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        sys.exit(f"octokit sign failed: {out.stderr}")
    return out.stdout.strip()


def mac(secret, message, digest=hashlib.sha256):
    if isinstance(message, str):
        message = message.encode()
    return hmac.new(secret.encode(), message, digest)


def main():
    req = json.load(sys.stdin)
    preset, secret, body = req["preset"], req["secret"], req["body"]
    ts = int(req.get("timestamp"))
    rid = req.get("id", "delivery-1")
    url = req.get("url", "")
    h = {}
    if preset in ("standard-webhooks", "svix"):
        from standardwebhooks import Webhook

        when = datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc)
        sig = Webhook(secret).sign(rid, when, body)
        p = "webhook" if preset == "standard-webhooks" else "svix"
        h = {f"{p}-id": rid, f"{p}-timestamp": str(ts), f"{p}-signature": sig}
    elif preset == "stripe":
        import stripe

        h = {"stripe-signature": stripe.WebhookSignature.generate_signature_header(body, secret, timestamp=ts)}
    elif preset == "slack":
        from slack_sdk.signature import SignatureVerifier

        sig = SignatureVerifier(secret).generate_signature(timestamp=str(ts), body=body)
        h = {"x-slack-request-timestamp": str(ts), "x-slack-signature": sig}
    elif preset == "github":
        h = {"x-hub-signature-256": octokit_sign(secret, body),
             "x-github-delivery": rid, "x-github-event": "issues"}
    elif preset == "shopify":
        h = {"x-shopify-hmac-sha256": base64.b64encode(mac(secret, body).digest()).decode(),
             "x-shopify-webhook-id": rid, "x-shopify-topic": "orders/create",
             "x-shopify-triggered-at": datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).isoformat()}
    elif preset == "gitlab":
        h = {"x-gitlab-token": secret, "x-gitlab-event-uuid": rid}
    elif preset == "zoom":
        h = {"x-zm-request-timestamp": str(ts),
             "x-zm-signature": "v0=" + mac(secret, f"v0:{ts}:{body}").hexdigest()}
    elif preset == "twilio":
        params = urllib.parse.parse_qsl(body, keep_blank_values=True)
        signed = url + "".join(k + v for k, v in sorted(params))
        h = {"x-twilio-signature": base64.b64encode(mac(secret, signed, hashlib.sha1).digest()).decode(),
             "i-twilio-idempotency-token": rid}
    elif preset == "square":
        h = {"x-square-hmacsha256-signature": base64.b64encode(mac(secret, url + body).digest()).decode()}
    elif preset == "hubspot":
        ms = str(ts * 1000)
        h = {"x-hubspot-request-timestamp": ms,
             "x-hubspot-signature-v3": base64.b64encode(mac(secret, "POST" + url + body + ms).digest()).decode()}
    elif preset == "linear":
        h = {"linear-signature": mac(secret, body).hexdigest(), "linear-delivery": rid, "linear-event": "Issue"}
    elif preset == "intercom":
        h = {"x-hub-signature": "sha1=" + mac(secret, body, hashlib.sha1).hexdigest()}
    elif preset == "paddle":
        h = {"paddle-signature": f"ts={ts};h1=" + mac(secret, f"{ts}:{body}").hexdigest()}
    elif preset == "typeform":
        h = {"typeform-signature": "sha256=" + base64.b64encode(mac(secret, body).digest()).decode()}
    elif preset == "calendly":
        h = {"calendly-webhook-signature": f"t={ts},v1=" + mac(secret, f"{ts}.{body}").hexdigest()}
    elif preset in ("bitbucket", "jira"):
        h = {"x-hub-signature": "sha256=" + mac(secret, body).hexdigest(),
             "x-request-uuid": rid, "x-atlassian-webhook-identifier": rid, "x-event-key": "repo:push"}
    elif preset == "woocommerce":
        h = {"x-wc-webhook-signature": base64.b64encode(mac(secret, body).digest()).decode(),
             "x-wc-webhook-delivery-id": rid, "x-wc-webhook-topic": "order.created"}
    elif preset == "sentry":
        h = {"sentry-hook-signature": mac(secret, body).hexdigest(), "request-id": rid,
             "sentry-hook-resource": "issue", "sentry-hook-timestamp": str(ts)}
    elif preset == "vercel":
        h = {"x-vercel-signature": mac(secret, body, hashlib.sha1).hexdigest()}
    elif preset == "twitch":
        stamp = datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        h = {"twitch-eventsub-message-id": rid, "twitch-eventsub-message-timestamp": stamp,
             "twitch-eventsub-message-signature": "sha256=" + mac(secret, rid + stamp + body).hexdigest(),
             "twitch-eventsub-subscription-type": "channel.follow",
             "twitch-eventsub-message-type": req.get("message_type", "notification")}
    elif preset == "hmac":
        h = {"x-signature": "sha512=" + mac(secret, f"{ts}.{body}", hashlib.sha512).hexdigest(),
             "x-timestamp": str(ts)}
    elif preset == "basic":
        h = {"authorization": "Basic " + base64.b64encode(secret.encode()).decode()}
    elif preset == "api-key":
        h = {"x-api-key": secret}
    else:
        sys.exit(f"unknown preset {preset}")
    json.dump(h, sys.stdout)


main()
