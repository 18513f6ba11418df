-- wrk script: POST a ~1 KiB binary-mode CloudEvent, a fresh id per request.
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
local body = '{"order":{"id":"ord-000000","customer":"cust-42","currency":"EUR","total":1234.56,'
  .. '"lines":[' .. string.rep('{"sku":"SKU-12345","qty":2,"price":12.5},', 20)
  .. '{"sku":"SKU-99999","qty":1,"price":1}]},"note":"' .. string.rep("x", 48) .. '"}'

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
