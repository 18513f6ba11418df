local n = #ARGV - 1
local last = redis.call('INCRBY', KEYS[2], n)
local first = last - n
for i = 1, n do
  redis.call('XADD', KEYS[1], '0-' .. (first + i), 'e', ARGV[i + 1], 't', ARGV[1])
end
return first
