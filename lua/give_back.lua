-- give_back.lua: return permits a process leased and did not use (idle key,
-- shutdown), so they are not stranded.
--
-- KEYS[1]  the key the permits were leased from (any of the three layouts:
--          a fixed-window hash, a token-bucket hash or a GCRA string).
-- ARGV[1]  algorithm  "fw", "tb" or "gc"
-- ARGV[2]  limit      permits per period
-- ARGV[3]  period_us  the period in microseconds
-- ARGV[4]  burst      bucket capacity (tb, gc)
-- ARGV[5]  returned   permits to give back (>= 1)
-- ARGV[6]  window     fw: the window index they were leased from
--
-- Returns  the number of permits actually given back: fixed-window permits
--          count only for the current or the next window (an ended window's
--          permits are worthless); a bucket is never filled past its burst.
-- Writes no key that does not exist and never lengthens a TTL.
-- Complexity: O(1).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local algorithm = ARGV[1]
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local returned = tonumber(ARGV[5])

if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end

if algorithm == 'fw' then
  local window = tonumber(ARGV[6])
  if window < math.floor(now / period) then return 0 end
  local f = string.format('%d', window)
  local used = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  local back = math.min(used, returned)
  if back > 0 then redis.call('HINCRBY', KEYS[1], f, -back) end
  return back
elseif algorithm == 'tb' then
  local state = redis.call('HMGET', KEYS[1], 'tk', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  if now > ts then tokens = math.min(burst, tokens + (now - ts) * limit / period) end
  local back = math.max(0, math.min(returned, burst - tokens))
  tokens = tokens + back
  -- HSET on an existing key keeps its TTL, which is already long enough:
  -- a fuller bucket is full sooner.
  redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens), 'ts', string.format('%d', now))
  return math.floor(back)
else
  local interval = period / limit
  local tat = tonumber(redis.call('GET', KEYS[1])) or now
  if tat <= now then return 0 end
  local back = math.min(returned, math.floor((tat - now) / interval))
  if back <= 0 then return 0 end
  tat = tat - back * interval
  redis.call('SET', KEYS[1], string.format('%d', math.ceil(tat)), 'PX', math.ceil((tat - now) / 1000) + 1)
  return back
end
