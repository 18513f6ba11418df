local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, s = pcall(cjson.decode, cur)
  if ok and type(s) == 'table' then
    if s.worker ~= ARGV[3] then return 0 end
    if s.state ~= 'RUNNING' then return 2 end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
