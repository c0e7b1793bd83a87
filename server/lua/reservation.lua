-- reservation.lua: what a request reserved, kept from the call that made
-- the reservation to the call that settles it (a stream's end, often on
-- another replica). src/reservation.rs mirrors it for the memory store.
--
-- KEYS[1]  the reservation's key (a string)
-- ARGV[1]  'put' or 'take'
-- ARGV[2]  put: the record (text, at most 512 bytes); take: the taking
--          call's identity
-- ARGV[3]  put: how long the record is kept, ms (> 0)
--
-- put keeps the record unless one is kept already (a second delivery of
-- the same put changes nothing) and returns {1}, or {0} when one was.
-- take returns the record's bytes and marks it taken by its caller; a
-- second delivery of the same take (its reply lost) gets the same bytes,
-- any other take {0} (settled already); {} when none is kept (never made,
-- or expired). A taken record stays until its expiry.
-- Complexity: O(1), and O(record length) for a take's bytes.
local key = KEYS[1]
if ARGV[1] == 'put' then
  local ttl = tonumber(ARGV[3])
  if not ttl or ttl <= 0 then return redis.error_reply('reservation: bad ttl') end
  local set = redis.call('SET', key, 'r ' .. ARGV[2], 'NX', 'PX', ttl)
  if set then return {1} end
  return {0}
end
if ARGV[1] == 'take' then
  local v = redis.call('GET', key)
  if not v then return {} end
  local by = ARGV[2]
  local record
  if string.sub(v, 1, 2) == 'r ' then
    record = string.sub(v, 3)
    redis.call('SET', key, 't ' .. by .. ' ' .. record, 'KEEPTTL')
  else
    local taker, rest = string.match(v, '^t (%S+) (.*)$')
    if taker ~= by then return {0} end
    record = rest
  end
  return {string.byte(record, 1, -1)}
end
return redis.error_reply('reservation: op must be put or take')
