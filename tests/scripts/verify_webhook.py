"""Verifies Standard Webhooks signatures with the reference implementation (`standardwebhooks`
on PyPI). Reads {"secret": ..., "requests": [{"headers": {...}, "body": "..."}]} on stdin;
exits non-zero naming the first request whose signature does not verify."""
import json
import sys

from standardwebhooks.webhooks import Webhook

data = json.load(sys.stdin)
hook = Webhook(data["secret"])
for i, request in enumerate(data["requests"]):
    try:
        hook.verify(request["body"].encode(), request["headers"])
    except Exception as e:  # noqa: BLE001 - report any verification failure
        print(f"request {i}: {type(e).__name__}: {e}")
        sys.exit(1)
# A tampered body must fail.
tampered = dict(data["requests"][0])
try:
    hook.verify((tampered["body"] + " ").encode(), tampered["headers"])
    print("tampered body verified")
    sys.exit(1)
except Exception:  # noqa: BLE001
    pass
print("ok", len(data["requests"]))
