-- refill_wait.lua: how long from `now` until a token bucket holds `need`
-- tokens, in whole microseconds, when it holds `tokens` at `ts` (the state
-- the key keeps after this call).
--
-- The quotient is rounded up, then checked against the very sum a later
-- call computes, tokens + (later - ts) * limit / period: floating point can
-- leave that sum a hair below `need`, which would deny a client that waited
-- exactly what it was told. A short wait grows by 1, 2, 4 ... microseconds
-- until the sum holds (a slow rate needs many microseconds per ulp).
-- Defines refill_wait; the token bucket scripts call it.
local function refill_wait(tokens, ts, now, need, limit, period)
  local at = ts + math.max(0, math.ceil((need - tokens) * period / limit))
  local step = 1
  while tokens + (at - ts) * limit / period < need do
    at = at + step
    step = step * 2
  end
  return math.max(0, at - now)
end
