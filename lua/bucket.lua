-- bucket.lua: a token bucket's hash as its scripts read it, and how long
-- it takes to refill. No KEYS or ARGV of its own, no return value: it
-- defines read_bucket and refill_wait, and token_bucket.lua and
-- lease_token_bucket.lua run after it.

-- The bucket at `key` at `now`: the tokens it keeps (`kept`, stored at
-- `ts`; a missing key is a full bucket, now), those refilled to now (at
-- most `burst`), and its give-back counter ("gb", nil if none).
local function read_bucket(key, now, limit, period, burst)
  local state = redis.call('HMGET', key, 'tk', 'ts', 'gb')
  local kept = tonumber(state[1])
  local ts = tonumber(state[2])
  if kept == nil or ts == nil then
    kept = burst
    ts = now
  end
  local tokens = kept
  if now > ts then
    tokens = math.min(burst, kept + (now - ts) * limit / period)
  end
  return kept, ts, tokens, tonumber(state[3])
end

-- How long from `now` until a bucket holds `need` tokens, in whole
-- microseconds, when it holds `tokens` at `ts` (the state the key keeps
-- after this call).
--
-- The quotient is rounded up, then checked against the very sum a later
-- call computes, tokens + (later - ts) * limit / period: floating point can
-- leave that sum a hair below `need`, which would deny a client that waited
-- exactly what it was told. A short wait grows by 1, 2, 4 ... microseconds
-- until the sum holds (a slow rate needs many microseconds per ulp).
local function refill_wait(tokens, ts, now, need, limit, period)
  local at = ts + math.max(0, math.ceil((need - tokens) * period / limit))
  local step = 1
  while tokens + (at - ts) * limit / period < need do
    at = at + step
    step = step * 2
  end
  return math.max(0, at - now)
end
