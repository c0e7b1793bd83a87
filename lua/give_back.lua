-- give_back.lua: return permits a process leased and did not use (idle key,
-- expired bucket lease, shutdown), so they are not stranded.
--
-- KEYS[1]  the key the permits were leased from (any of the three layouts:
--          a fixed-window hash, a token-bucket hash or a GCRA hash).
-- KEYS[2]  the give-back's identity: a string key in the same hash slot,
--          written with a 60 s TTL. A second delivery of the same give-back
--          (a client retry, a pipeline resent after NOSCRIPT) finds it and
--          returns the first answer without changing anything.
-- ARGV[1]  layout     "w" (a window hash: fixed or sliding window), "tb"
--                      or "gc"
-- ARGV[2]  limit      permits per period
-- ARGV[3]  period_us  the period in microseconds
-- ARGV[4]  burst      bucket capacity (tb, gc)
-- ARGV[5]  returned   permits to give back (>= 1)
-- ARGV[6]  w: the window index they were leased from; tb, gc: the lease's
--          origin time (its reply's now_us)
-- ARGV[7]  w: how long to remember the identity, ms (at least 60 s; a
--          refund's lasts its window)
-- ARGV[8]  w: "1" for a refund: a second delivery answers 2^52 plus the
--          first answer, so the caller can tell a repeat from a first send
-- ARGV[7]  tb, gc: the bucket's level right after that lease (its reply's
--          level), in thousandths of a permit, rounded up
-- ARGV[8]  tb, gc: the key's give-back counter then (its reply's given_back;
--          0 from an exact check of a key that had none)
-- ARGV[9]  tb, gc: "1" for a refund (as ARGV[8] for w)
-- ARGV[10] tb, gc: how long to remember the identity, ms (at least 60 s; a
--          refund's until its bucket would be full again)
--
-- Returns  the number of permits actually given back: fixed-window permits
--          count only for the current or the next window (an ended window's
--          permits are worthless). A bucket gets back only what it could
--          have held had the lease never been taken: while the lease was
--          out, the bucket may have reached its cap and dropped refills,
--          and the returned permits must not bring those back. Its level
--          since the lease is at most level + refill since + what others
--          gave back since ("gb" counts it; it starts at the key's creation
--          time, so a key that expired and was recreated refuses old
--          give-backs), and the give-back is capped at burst minus that.
-- Writes no key that does not exist and never lengthens a TTL (the identity
-- key aside).
-- Complexity: O(1).
local seen = redis.call('GET', KEYS[2])
if seen then
  if (ARGV[1] == 'w' and ARGV[8] == '1') or (ARGV[1] ~= 'w' and ARGV[9] == '1') then
    return 4503599627370496 + tonumber(seen)
  end
  return tonumber(seen)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local algorithm = ARGV[1]
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local returned = tonumber(ARGV[5])

local remember = 60000
if algorithm == 'w' then
  remember = math.max(remember, tonumber(ARGV[7]) or 0)
else
  remember = math.max(remember, tonumber(ARGV[10]) or 0)
end

local function done(back)
  redis.call('SET', KEYS[2], string.format('%d', back), 'PX', string.format('%d', remember))
  return back
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return done(0)
end

if algorithm == 'w' then
  local window = tonumber(ARGV[6])
  if window < math.floor(now / period) then return done(0) end
  local f = string.format('%d', window)
  local used = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  local back = math.min(used, returned)
  if back > 0 then redis.call('HINCRBY', KEYS[1], f, -back) else back = 0 end
  return done(back)
end

local origin = tonumber(ARGV[6])
local level = tonumber(ARGV[7]) / 1000
local gb_then = tonumber(ARGV[8])
local rate = limit / period
-- A key no lease has written has no counter: nothing was given back to it.
local gb = tonumber(redis.call('HGET', KEYS[1], 'gb')) or 0
if gb < gb_then or origin > now then
  return done(0)
end
local peak = level + (now - origin) * rate + (gb - gb_then)

if algorithm == 'tb' then
  local state = redis.call('HMGET', KEYS[1], 'tk', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  if now > ts then tokens = math.min(burst, tokens + (now - ts) * rate) end
  local back = math.floor(math.max(0, math.min(returned, burst - tokens, burst - peak)))
  if back <= 0 then return done(0) end
  -- HSET on an existing key keeps its TTL, which is already long enough:
  -- a fuller bucket is full sooner.
  redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens + back), 'ts', string.format('%d', now),
    'gb', string.format('%d', gb + back))
  return done(back)
else
  local interval = period / limit
  local tat = tonumber(redis.call('HGET', KEYS[1], 't')) or now
  if tat <= now then return done(0) end
  local back = math.floor(math.max(0, math.min(returned, (tat - now) / interval, burst - peak)))
  if back <= 0 then return done(0) end
  tat = tat - back * interval
  redis.call('HSET', KEYS[1], 't', string.format('%d', math.ceil(tat)), 'gb', string.format('%d', gb + back))
  return done(back)
end
