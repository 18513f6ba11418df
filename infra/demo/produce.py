"""The compose demo's producer: posts a few CloudEvents to each Sluice replica, then exits.

Round robin over the replicas given on the command line (base URLs); half of the events
are orders (they also go to RocketMQ), the rest are plain events (receiver only). Prints
each answer. Standard library only.
"""

import json
import sys
import time
import urllib.request


def post(base, event_id, event_type):
    request = urllib.request.Request(
        f"{base}/buses/default/events",
        data=json.dumps({"id": event_id, "n": event_id}).encode(),
        method="POST",
        headers={
            "content-type": "application/json",
            "ce-specversion": "1.0",
            "ce-id": event_id,
            "ce-source": "/compose-demo",
            "ce-type": event_type,
            "ce-partitionkey": f"customer-{int(event_id.rsplit('-', 1)[1]) % 3}",
        },
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status, answer.read().decode()


if __name__ == "__main__":
    replicas = sys.argv[1:] or ["http://127.0.0.1:8080"]
    for i in range(30):
        base = replicas[i % len(replicas)]
        kind = "com.example.order.created" if i % 2 == 0 else "com.example.page.viewed"
        status, body = post(base, f"demo-{i}", kind)
        print(f"{base} {kind} demo-{i}: {status} {body}", flush=True)
        time.sleep(0.2)
