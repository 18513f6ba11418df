if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local current = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '-1')
if tonumber(ARGV[3]) > current then redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) end
return 1
