local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
