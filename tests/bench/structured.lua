-- wrk script: POST the ~1 KiB event of post.lua in structured mode
-- (application/cloudevents+json), a fresh id per request.
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or ""
local file = assert(io.open(dir .. "event-data.json", "rb"))
local data = file:read("*a"):gsub("%s+$", "")
file:close()

wrk.method = "POST"
wrk.headers["content-type"] = "application/cloudevents+json"
local head = '{"specversion":"1.0","source":"/bench/wrk","type":"com.example.order.created",'
  .. '"datacontenttype":"application/json","id":"'
local tail = '","data":' .. data .. '}'

request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, head .. thread_id .. "-" .. counter .. tail)
end
