-- gcra.lua: exact generic cell rate algorithm, one call per decision.
--
-- KEYS[1]  hash; "t" = the theoretical arrival time (TAT) in redis_now_us,
--          "gb" = permits given back so far (see give_back.lua; kept here).
-- ARGV[1]  limit      permits per period (integer >= 1)
-- ARGV[2]  period_us  the period in microseconds
-- ARGV[3]  burst      permits that may arrive at once (integer >= 1)
-- ARGV[4]  cost       permits this request takes (integer >= 0; 0 = peek,
--                     always allowed)
--
-- Returns  {allowed (0|1), remaining, reset_after_us (until the TAT, when the
--          full burst is available again), retry_after_us (0 allowed,
--          -1 never), now_us, level (permits available after it, in
--          thousandths, rounded up), given_back (the key's "gb", 0 if none)}
--          `now_us`, `level` and `given_back` are what this decision took
--          permits at: a refund (give_back.lua) sends them back.
--
-- Emission interval T = period / limit; tolerance = burst * T. A request of
-- cost n is allowed when max(TAT, now) + n*T - now <= tolerance.
-- The key expires at its TAT, after which a missing key means the same.
-- Complexity: O(1).
--
-- Defines check(KEYS, ARGV, apply); lua/check_one.lua calls it once,
-- lua/check_all.lua once per quota. With apply false it decides and writes
-- nothing.
local function check(KEYS, ARGV, apply)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local limit = tonumber(ARGV[1])
  local period = tonumber(ARGV[2])
  local burst = tonumber(ARGV[3])
  local cost = tonumber(ARGV[4])

  local interval = period / limit
  local tolerance = burst * interval
  local state = redis.call('HMGET', KEYS[1], 't', 'gb')
  local tat = tonumber(state[1] or '0') or 0
  local gb = tonumber(state[2]) or 0
  if tat < now then tat = now end

  local new_tat = tat + cost * interval
  local allowed = 0
  local retry = 0
  if cost == 0 or new_tat - now <= tolerance then
    allowed = 1
    if cost > 0 and apply then
      tat = new_tat
      redis.call('HSET', KEYS[1], 't', string.format('%d', math.ceil(tat)))
      redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil((tat - now) / 1000) + 1))
    end
  elseif cost > burst then
    retry = -1
  else
    retry = math.ceil(new_tat - now - tolerance)
  end

  local remaining = math.floor((tolerance - (tat - now)) / interval + 1e-9)
  if remaining < 0 then remaining = 0 end
  local level = math.max(0, math.ceil(((tolerance - (tat - now)) / interval - 1e-9) * 1000))
  return {allowed, remaining, math.ceil(tat - now), retry, now, level, gb}
end
