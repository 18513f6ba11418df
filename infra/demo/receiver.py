"""The compose demo's sample receiver: logs every event Sluice POSTs to it.

One JSON line per request on stdout: the CloudEvents attributes (binary mode's ce-*
headers) and the body. Answers 204, so Sluice counts the delivery as done. GET /healthz
answers 200 for the compose health check. Standard library only: it runs on the official
python image as it is.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's naming)
        status = 200 if self.path == "/healthz" else 404
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        event = {k[3:]: v for k, v in self.headers.items() if k.lower().startswith("ce-")}
        event["datacontenttype"] = self.headers.get("content-type")
        try:
            event["data"] = json.loads(body) if body else None
        except ValueError:
            event["data"] = body.decode("utf-8", "replace")
        print(json.dumps({"path": self.path, "event": event}), flush=True)
        self.send_response(204)
        self.end_headers()

    def log_message(self, format, *args):  # noqa: A002
        pass  # one line per event is enough


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    ThreadingHTTPServer(("0.0.0.0", port), Receiver).serve_forever()
