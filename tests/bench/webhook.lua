-- wrk script: a GitHub webhook (the body post.lua sends as data), signed with
-- X-Hub-Signature-256 as GitHub does, a fresh X-GitHub-Delivery per request (each one
-- verified and deduplicated). ingest.sh passes the signature in WEBHOOK_SIGNATURE.
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
-- The event data (~1 KiB), shared with ingest.sh and the other script, next to this one.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or ""
local file = assert(io.open(dir .. "event-data.json", "rb"))
local body = file:read("*a")
file:close()

wrk.method = "POST"
wrk.body = body
wrk.headers["content-type"] = "application/json"
wrk.headers["x-github-event"] = "issues"
wrk.headers["x-hub-signature-256"] = os.getenv("WEBHOOK_SIGNATURE")

request = function()
  counter = counter + 1
  wrk.headers["x-github-delivery"] = thread_id .. "-" .. counter
  return wrk.format()
end
