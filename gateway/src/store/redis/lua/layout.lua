-- Moves the keys of the first layout (untagged, before Redis Cluster support) to the
-- hash-tagged one, in one step, and marks the layout. One server only. KEYS: the layout
-- mark, the members set. ARGV: the member TTL (ms), the old dedup record prefix
-- (`{p}:dedup:`), the number of renames, then old/new name pairs, then old index / new tag
-- pairs (an index's records are renamed into the tag with it). Answers {0, 0} when the
-- layout was current, {1, keys moved} after moving, {-1, live workers} when workers are
-- still heartbeating (nothing moved: they would go on writing the old names).
if redis.call('GET', KEYS[1]) == '2' then return {0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[1]), '+inf')
if live > 0 then return {-1, live} end
local old_record = ARGV[2]
local renames = tonumber(ARGV[3])
local moved = 0
local function move(from, to)
  if redis.call('EXISTS', from) == 1 then
    redis.call('RENAME', from, to)
    moved = moved + 1
  end
end
for i = 0, renames - 1 do
  move(ARGV[4 + 2 * i], ARGV[5 + 2 * i])
end
for i = 4 + 2 * renames, #ARGV, 2 do
  local old_index, tag = ARGV[i], ARGV[i + 1]
  if redis.call('EXISTS', old_index) == 1 then
    local index = tag .. ':dedup-index'
    local life = redis.call('PTTL', old_index)
    local members = redis.call('ZRANGE', old_index, 0, -1, 'WITHSCORES')
    for j = 1, #members, 2 do
      local record = members[j]
      if string.sub(record, 1, #old_record) == old_record then
        local renamed = tag .. ':dedup:' .. string.sub(record, #old_record + 1)
        move(record, renamed)
        redis.call('ZADD', index, members[j + 1], renamed)
      end
    end
    redis.call('DEL', old_index)
    if life > 0 then redis.call('PEXPIRE', index, life) end
    moved = moved + 1
  end
end
redis.call('SET', KEYS[1], '2')
return {1, moved}
