-- lease_token_bucket.lua: lease tokens from a token bucket to one process,
-- and record the tokens it admitted on credit.
--
-- KEYS[1]  hash; "tk" tokens, "ts" redis_now_us of the last update, "gb"
--          tokens given back so far (the same key as token_bucket.lua).
-- KEYS[2]  optional, only when debt > 0: the report's identity (a string key
--          in the same hash slot); a second delivery records no debt again.
-- ARGV[1]  limit      tokens added per period
-- ARGV[2]  period_us  the period in microseconds
-- ARGV[3]  burst      bucket capacity
-- ARGV[4]  want       tokens asked for (>= 0)
-- ARGV[5]  share_cap  fraction (0, 1] of the tokens present one lease may take
-- ARGV[6]  debt       tokens admitted on credit, not yet taken (>= 0)
-- ARGV[7]  need       the fewest tokens the waiting request needs (>= 1):
--                     below it nothing is granted
-- ARGV[8]  ceiling    the most this process takes in one lease: leases are
--                     at least min(ceiling, share_cap * available)
--
-- Returns  {granted, remaining (whole tokens left), 0, reset_after_us (until
--          full), retry_after_us (when nothing was granted: until the
--          `need` tokens are present; else 0), now_us, uncovered (debt beyond the
--          tokens present), 0, level (tokens left, in thousandths, rounded up), given_back
--          (the key's "gb")}
--
-- `now_us`, `level` and `given_back` are the lease's origin: a later
-- give-back sends them, so the store can tell how full the bucket may have
-- been meanwhile (give_back.lua). Debt is taken even past empty, down to
-- one burst below zero (what lies beyond is overshoot all the same, and is
-- counted in `uncovered`), so credit never becomes free. The key expires
-- when the bucket would be full. Complexity: O(1). Runs after
-- lua/bucket.lua.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local share = tonumber(ARGV[5])
local debt = tonumber(ARGV[6])
local need = tonumber(ARGV[7])
local ceiling = tonumber(ARGV[8] or '0')

local kept, ts, tokens, gb = read_bucket(KEYS[1], now, limit, period, burst)

local uncovered = 0
if debt > 0 and KEYS[2] then
  local seen = redis.call('GET', KEYS[2])
  if seen then
    uncovered = tonumber(seen)
    debt = 0
  end
end
local reported = debt
if debt > 0 then
  uncovered = math.max(0, debt - math.max(0, tokens))
  tokens = math.max(-burst, tokens - debt)
end

local available = math.max(0, math.floor(tokens))
local granted = 0
if available >= math.min(need, burst) then
  local cap = math.max(need, math.floor(available * share))
  granted = math.min(want, available, cap)
  -- Headroom: a share of what the bucket holds, however little this
  -- process has used so far, so a key far under its limit is served in
  -- few leases; share_cap keeps it from draining a bucket others need.
  local roomy = math.min(ceiling, math.floor(available * share))
  if roomy > granted then granted = math.min(roomy, available) end
end
tokens = tokens - granted

local reset = math.ceil((burst - tokens) * period / limit)
local written = granted > 0 or debt > 0
if written then
  if gb == nil then gb = now end
  redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens), 'ts', string.format('%d', now),
    'gb', string.format('%d', gb))
  redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil(reset / 1000) + 1))
end
if reported > 0 and KEYS[2] then
  redis.call('SET', KEYS[2], string.format('%d', math.ceil(uncovered)), 'PX', 60000)
end
local retry = 0
if granted == 0 then
  -- From the state the key keeps: what was written now, else as it was.
  if written then
    retry = refill_wait(tokens, now, now, math.min(need, burst), limit, period)
  else
    retry = refill_wait(kept, ts, now, math.min(need, burst), limit, period)
  end
  retry = math.max(1, retry)
end
return {granted, math.max(0, math.floor(tokens)), 0, reset, retry, now, math.ceil(uncovered), 0,
  math.ceil(tokens * 1000), gb or 0}
