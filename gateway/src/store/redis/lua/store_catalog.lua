local held = redis.call('HMGET', KEYS[1], 'version', 'id')
local version = held[1] or '0'
local id = held[2] or ''
if version ~= ARGV[1] or id ~= ARGV[2] then return {'0', version, id} end
redis.call('HSET', KEYS[1], 'version', ARGV[3], 'id', ARGV[4], 'digest', ARGV[5], 'toml', ARGV[6], 'versions', ARGV[7])
redis.call('PUBLISH', ARGV[8], 'config:' .. ARGV[3])
return {'1'}
