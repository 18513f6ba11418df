if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-1, 0} end
local now = dedup_now()
redis.call('SET', KEYS[1], 'done', 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), KEYS[1])
local size, evicted = dedup_bound(KEYS[2], now, ARGV[2], tonumber(ARGV[3]))
return {size, evicted}
