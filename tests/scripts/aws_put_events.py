"""Puts events on a Sluice bus with boto3's EventBridge client (`events.put_events`), as
an AWS user's code does, pointed at the gateway with `endpoint_url`.

Reads one JSON object on standard input:
    {"endpoint": "http://127.0.0.1:PORT", "region": "us-east-1",
     "access_key": "AKIA...", "secret": "...", "entries": [ {PutEvents entry}, ... ]}
and prints one JSON object: {"status": 200, "response": {"FailedEntryCount", "Entries"}}
when the call returned, or {"error": {"code", "message", "status"}} when the SDK raised
(ClientError), so the test sees exactly what boto3 parsed.
"""

import json
import sys

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError


def main() -> None:
    spec = json.load(sys.stdin)
    client = boto3.client(
        "events",
        endpoint_url=spec["endpoint"],
        region_name=spec.get("region", "us-east-1"),
        aws_access_key_id=spec["access_key"],
        aws_secret_access_key=spec["secret"],
        # One attempt: a refusal must show as the SDK's error, not after retries.
        config=Config(retries={"max_attempts": 1, "mode": "standard"}),
    )
    try:
        response = client.put_events(Entries=spec["entries"])
    except ClientError as e:
        print(
            json.dumps(
                {
                    "error": {
                        "code": e.response["Error"]["Code"],
                        "message": e.response["Error"].get("Message", ""),
                        "status": e.response["ResponseMetadata"]["HTTPStatusCode"],
                    }
                }
            )
        )
        return
    status = response.pop("ResponseMetadata", {}).get("HTTPStatusCode")
    print(json.dumps({"status": status, "response": response}))


if __name__ == "__main__":
    main()
