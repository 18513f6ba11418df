local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf', 'WITHSCORES')
local out = {}
for i = 1, #r, 2 do
  out[#out + 1] = r[i]
  out[#out + 1] = tostring(math.max(0, now - tonumber(r[i + 1])))
end
return out
