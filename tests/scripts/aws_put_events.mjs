// Puts events on a Sluice bus with the AWS SDK for JavaScript v3
// (`@aws-sdk/client-eventbridge`, `PutEventsCommand`), pointed at the gateway with
// `endpoint`. The SDK is installed by `make aws-node` into AWS_NODE_DIR.
//
// Reads one JSON object on standard input (the same as aws_put_events.py):
//   {"endpoint", "region", "access_key", "secret", "entries": [...]}
// and prints {"status", "response": {"FailedEntryCount", "Entries"}} or
// {"error": {"code", "message", "status"}} (the SDK's parsed exception).
import { createRequire } from "node:module";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const dir = process.env.AWS_NODE_DIR || path.join(os.homedir(), ".cache/sluice/aws-node");
if (!fs.existsSync(path.join(dir, "node_modules/@aws-sdk/client-eventbridge"))) {
  console.error(`@aws-sdk/client-eventbridge is not installed in ${dir}: run \`make aws-node\``);
  process.exit(2);
}
const require = createRequire(path.join(dir, "package.json"));
const { EventBridgeClient, PutEventsCommand } = require("@aws-sdk/client-eventbridge");

let input = "";
for await (const chunk of process.stdin) input += chunk;
const spec = JSON.parse(input);

const client = new EventBridgeClient({
  endpoint: spec.endpoint,
  region: spec.region ?? "us-east-1",
  credentials: { accessKeyId: spec.access_key, secretAccessKey: spec.secret },
  maxAttempts: 1,
});
try {
  const out = await client.send(new PutEventsCommand({ Entries: spec.entries }));
  const status = out.$metadata?.httpStatusCode;
  delete out.$metadata;
  console.log(JSON.stringify({ status, response: out }));
} catch (e) {
  console.log(
    JSON.stringify({
      error: { code: e.name, message: e.message, status: e.$metadata?.httpStatusCode },
    }),
  );
}
