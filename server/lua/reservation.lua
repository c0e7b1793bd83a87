-- reservation.lua: what a request reserved, kept from the call that made
-- the reservation to the call that settles it (a stream's end, often on
-- another replica). src/reservation.rs mirrors it for the memory store.
--
-- KEYS[1]  the reservation's key (a string)
-- ARGV[1]  'put' or 'take'
-- ARGV[2]  the calling request's identity (a put's, a take's: a second
--          delivery of the same call carries the same)
-- ARGV[3]  put: the record (text, at most 512 bytes)
-- ARGV[4]  put: how long the record is kept, ms (> 0)
--
-- put keeps the record and returns {1}. A second delivery of the same put
-- changes nothing ({1}); a put of another request under a key already
-- kept (a request id sent twice) spoils it ({0}): from then on every take
-- finds nothing, so each settlement of that identity is charged whole.
-- take returns the record's bytes and marks it taken by its caller; a
-- second delivery of the same take (its reply lost) gets the same bytes,
-- any other take {0} (settled already); {} when none is kept (never made,
-- spoilt, or expired). A record stays until its expiry.
-- Complexity: O(1), and O(record length) for a take's bytes.
local key = KEYS[1]
local by = ARGV[2]
local v = redis.call('GET', key)
if ARGV[1] == 'put' then
  local ttl = tonumber(ARGV[4])
  if not ttl or ttl <= 0 then return redis.error_reply('reservation: bad ttl') end
  if not v then
    redis.call('SET', key, 'r ' .. by .. ' ' .. ARGV[3], 'PX', ttl)
    return {1}
  end
  if string.match(v, '^r (%S+) ') == by then return {1} end
  redis.call('SET', key, 'x', 'KEEPTTL')
  return {0}
end
if ARGV[1] == 'take' then
  if not v or v == 'x' then return {} end
  local record
  local maker, rest = string.match(v, '^r (%S+) (.*)$')
  if maker then
    record = rest
    redis.call('SET', key, 't ' .. by .. ' ' .. record, 'KEEPTTL')
  else
    local taker, taken = string.match(v, '^t (%S+) (.*)$')
    if taker ~= by then return {0} end
    record = taken
  end
  return {string.byte(record, 1, -1)}
end
return redis.error_reply('reservation: op must be put or take')
