"""Posts one binary-mode and one structured-mode event with the official CloudEvents
Python SDK (the `cloudevents` package, 2.x core API).

Usage: post_with_python_sdk.py URL. Exits non-zero unless both are answered 202.
"""

import json
import sys
import urllib.request

from cloudevents.core.bindings import http
from cloudevents.core.v1.event import CloudEvent


def post(url, message):
    request = urllib.request.Request(
        url, data=message.body, headers=message.headers, method="POST"
    )
    with urllib.request.urlopen(request) as response:
        answer = json.loads(response.read())
        if response.status != 202 or answer["failedEntryCount"] != 0:
            raise SystemExit(f"unexpected answer {response.status}: {answer}")
        print(response.status, answer)


def event(event_id):
    attributes = {
        "id": event_id,
        "type": "com.example.python",
        "source": "https://example.com/python-sdk",
        "datacontenttype": "application/json",
        "subject": "café au lait",
        "tenant": "acme",
    }
    return CloudEvent(attributes, {"message": "hello from the python sdk"})


def main():
    url = sys.argv[1]
    post(url, http.to_binary_event(event("py-binary")))
    post(url, http.to_structured_event(event("py-structured")))


if __name__ == "__main__":
    main()
