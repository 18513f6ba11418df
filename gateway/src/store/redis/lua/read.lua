local start = ARGV[1]
local max = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
local out = {}
local used = 0
while #out < max and used < budget do
  local want = math.min(max - #out, 32)
  local entries = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', want)
  for i = 1, #entries do
    if used >= budget then
      return out
    end
    local fields = entries[i][2]
    for j = 2, #fields, 2 do
      used = used + #fields[j]
    end
    out[#out + 1] = entries[i]
    start = '(' .. entries[i][1]
  end
  if #entries < want then
    break
  end
end
return out
