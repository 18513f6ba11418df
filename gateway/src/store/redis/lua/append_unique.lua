local now = dedup_now()
local window = tonumber(ARGV[2])
local out = {}
local added = 0
for i = 1, #ARGV - 3 do
  local key = KEYS[i + 3]
  local held = redis.call('GET', key)
  if held == 'done' then
    out[i] = -1
  elseif held then
    out[i] = -2
  else
    local next = redis.call('INCR', KEYS[2])
    redis.call('XADD', KEYS[1], '0-' .. next, 'e', ARGV[i + 3], 't', ARGV[1])
    redis.call('SET', key, 'done', 'PX', ARGV[2])
    redis.call('ZADD', KEYS[3], now + window, key)
    added = added + 1
    out[i] = next - 1
  end
end
local size, evicted = -1, 0
if added > 0 then
  size, evicted = dedup_bound(KEYS[3], now, ARGV[2], tonumber(ARGV[3]))
end
out[#out + 1] = size
out[#out + 1] = evicted
return out
