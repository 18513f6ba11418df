local recorded = redis.call('GET', KEYS[1])
if recorded then return tonumber(recorded) end
redis.call('SET', KEYS[1], ARGV[1])
return tonumber(ARGV[1])
