local current = redis.call('GET', KEYS[1])
if current then
  local owner = string.match(current, '^(.*)|%d+$')
  if owner ~= ARGV[1] then return -1 end
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. epoch, 'PX', ARGV[2])
return epoch
