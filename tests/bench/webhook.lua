-- wrk script: a GitHub webhook (the body post.lua sends as data), signed with
-- X-Hub-Signature-256 as GitHub does, a fresh X-GitHub-Delivery per request (each one
-- verified and deduplicated). ingest.sh passes the signature in WEBHOOK_SIGNATURE.
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
local body = '{"order":{"id":"ord-000000","customer":"cust-42","currency":"EUR","total":1234.56,'
  .. '"lines":[' .. string.rep('{"sku":"SKU-12345","qty":2,"price":12.5},', 20)
  .. '{"sku":"SKU-99999","qty":1,"price":1}]},"note":"' .. string.rep("x", 48) .. '"}'

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
