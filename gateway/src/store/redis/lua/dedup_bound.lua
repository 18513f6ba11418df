local function dedup_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function dedup_bound(index, now, window, cap)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
  local size = redis.call('ZCARD', index)
  local evicted = 0
  if size > cap then
    local popped = redis.call('ZPOPMIN', index, size - cap)
    for j = 1, #popped, 2 do
      if redis.call('GET', popped[j]) == 'done' then
        redis.call('DEL', popped[j])
        evicted = evicted + 1
      end
    end
    size = cap
  end
  if redis.call('PTTL', index) < tonumber(window) then
    redis.call('PEXPIRE', index, window)
  end
  return size, evicted
end
