-- token_bucket.lua: exact token bucket, one call per decision.
--
-- KEYS[1]  hash; "tk" = tokens (may be fractional, negative after debt),
--          "ts" = redis_now_us of the last update, "gb" = permits given back
--          so far (see give_back.lua; kept, not used here).
-- ARGV[1]  limit      tokens added per period (integer >= 1)
-- ARGV[2]  period_us  the period in microseconds
-- ARGV[3]  burst      bucket capacity (integer >= 1)
-- ARGV[4]  cost       tokens this request takes (integer >= 0; 0 = peek,
--                     always allowed, even when debt left the bucket negative)
--
-- Returns  {allowed (0|1), remaining (whole tokens), reset_after_us (until
--          full), retry_after_us (0 allowed, -1 never), now_us, level (tokens
--          left, in thousandths, rounded up), given_back (the key's "gb", 0 if none)}
--          `now_us`, `level` and `given_back` are what this decision took
--          tokens at: a refund (give_back.lua) sends them back.
--
-- A missing key is a full bucket. The key expires when the bucket would be
-- full again, at which point forgetting it changes nothing. Quotas are
-- validated so that this TTL stays far below 2^53 ms (formatted with %d).
-- Complexity: O(1).
--
-- Defines check(KEYS, ARGV, apply) after lua/bucket.lua;
-- lua/check_one.lua calls it once,
-- lua/check_all.lua once per quota. With apply false it decides and writes
-- nothing.
local function check(KEYS, ARGV, apply)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local limit = tonumber(ARGV[1])
  local period = tonumber(ARGV[2])
  local burst = tonumber(ARGV[3])
  local cost = tonumber(ARGV[4])

  local kept, ts, tokens, gb = read_bucket(KEYS[1], now, limit, period, burst)
  gb = gb or 0

  local allowed = 0
  local retry = 0
  if cost == 0 or cost <= tokens then
    allowed = 1
    if apply then tokens = tokens - cost end
  elseif cost > burst then
    retry = -1
  else
    -- A denial writes nothing: the key keeps `kept` at `ts`.
    retry = refill_wait(kept, ts, now, cost, limit, period)
  end

  local reset = math.ceil((burst - tokens) * period / limit)
  if allowed == 1 and cost > 0 and apply then
    redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens), 'ts', string.format('%d', now))
    redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil(reset / 1000) + 1))
  end
  return {allowed, math.max(0, math.floor(tokens)), reset, retry, now,
    math.max(0, math.ceil(tokens * 1000)), gb}
end
