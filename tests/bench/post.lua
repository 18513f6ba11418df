-- wrk script: POST a ~1 KiB binary-mode CloudEvent, a fresh id per request.
-- DELAY_MS (optional): each connection waits this long after an answer before its next
-- request, for a run at a set rate (connections / delay) instead of as fast as it goes.
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
wrk.headers["ce-specversion"] = "1.0"
wrk.headers["ce-source"] = "/bench/wrk"
wrk.headers["ce-type"] = "com.example.order.created"

request = function()
  counter = counter + 1
  wrk.headers["ce-id"] = thread_id .. "-" .. counter
  return wrk.format()
end

local pause = tonumber(os.getenv("DELAY_MS") or "")
if pause then
  delay = function()
    return pause
  end
end
