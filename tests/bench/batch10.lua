-- wrk script: POST the same 10 events per request (the ~1 KiB order of event-data.json,
-- each with its own id) in one of three forms, chosen by the MODE environment variable:
--   cloudevents  POST /buses/default/events, application/cloudevents-batch+json
--   aws          POST /, AWS EventBridge PutEvents (X-Amz-Target, JSON 1.1), 10 entries
--   rocketmq     POST /putEvents, RocketMQ EventBridge, batch mode, bus in aliyuneventbusname
-- The body is built once: every form costs wrk the same, so the gateway's cost differs.
-- The stored events are the same in the three forms: the CloudEvents carry the `time`,
-- `account` and `region` PutEvents gives each event (docs/coming-from-aws-eventbridge.md).
local mode = os.getenv("MODE") or "cloudevents"
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or ""
local file = assert(io.open(dir .. "event-data.json", "rb"))
local data = file:read("*a"):gsub("%s+$", "")
file:close()
local thread_id = tostring(math.random(1, 1000000000))

local function json_string(s)
  return '"' .. s:gsub('\\', '\\\\'):gsub('"', '\\"') .. '"'
end

local parts = {}
for i = 1, 10 do
  local id = thread_id .. "-" .. i
  if mode == "aws" then
    parts[i] = '{"Source":"/bench/wrk","DetailType":"com.example.order.created",'
      .. '"Time":"2024-05-01T10:00:00Z","Detail":' .. json_string(data) .. '}'
  else
    parts[i] = '{"specversion":"1.0","id":"' .. id .. '","source":"/bench/wrk",'
      .. '"type":"com.example.order.created","time":"2024-05-01T10:00:00Z",'
      .. '"account":"000000000000","region":"us-east-1",'
      .. '"datacontenttype":"application/json","data":' .. data .. '}'
  end
end

wrk.method = "POST"
if mode == "aws" then
  wrk.body = '{"Entries":[' .. table.concat(parts, ",") .. ']}'
  wrk.headers["content-type"] = "application/x-amz-json-1.1"
  wrk.headers["x-amz-target"] = "AWSEvents.PutEvents"
elseif mode == "rocketmq" then
  wrk.body = '[' .. table.concat(parts, ",") .. ']'
  wrk.headers["content-type"] = "application/cloudevents-batch+json"
  wrk.headers["aliyuneventbusname"] = "default"
else
  wrk.body = '[' .. table.concat(parts, ",") .. ']'
  wrk.headers["content-type"] = "application/cloudevents-batch+json"
end

-- Counts answers that are not 2xx or that report failed entries, so a run where the
-- gateway refuses everything cannot pass for a fast one.
local failed = 0
response = function(status, headers, body)
  if status < 200 or status >= 300 or not body:find('"[Ff]ailedEntryCount":%s*0') then
    failed = failed + 1
  end
end

done = function(summary, latency, requests)
  io.write(string.format("refused-or-failed %d\n", failed))
end
