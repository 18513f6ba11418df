if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
if n > 0 then redis.call('HSET', KEYS[2], unpack(ARGV, 3, 2 + 2 * n)) end
if #ARGV > 2 + 2 * n then redis.call('HDEL', KEYS[2], unpack(ARGV, 3 + 2 * n, #ARGV)) end
return 1
