-- window_check.lua: exact check-and-count of a window algorithm (fixed or
-- sliding window), one call per decision.
-- KEYS[1]  hash; field = window index (floor(redis_now_us / period_us)),
--          value = permits counted in that window (the lease script's
--          hash: exact and hybrid limiters of one key share it).
-- ARGV[1]  limit      permits per window (fixed), per trailing period
--                     (sliding) (integer >= 1)
-- ARGV[2]  period_us  the period in microseconds (integer >= 1000)
-- ARGV[3]  cost       permits this request takes (integer >= 0; 0 = peek)
--
-- Returns  {allowed (0|1), remaining, reset_after_us, retry_after_us, now_us,
--          0, 0} (the last two are the bucket scripts' level and give-back
--          counter)
--          remaining: limit minus the load after this call; reset_after_us:
--          until the whole limit is free again if nothing more is admitted;
--          retry_after_us is 0 when allowed, -1 when cost > limit (never),
--          else how long until the load has room for cost.
--
-- Sent with a carry file in front of it (lua/carry_fixed_window.lua or
-- lua/carry_sliding_window.lua), which defines carry, wait_for and
-- reset_after (see lease_window.lua).
-- The load is count(current) + carry: the count alone for the fixed
-- window; for the sliding window see carry_sliding_window.lua.
-- Time comes from Redis TIME only. Windows older than the previous one are
-- deleted; the key expires one period after the end of its newest window.
-- Complexity: O(1), and once per window O(fields) to forget ended windows.
--
-- Defines check(KEYS, ARGV, apply); lua/check_one.lua calls it once,
-- lua/check_all.lua once per quota. With apply false it decides and writes
-- nothing.
local function check(KEYS, ARGV, apply)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local limit = tonumber(ARGV[1])
  local period = tonumber(ARGV[2])
  local cost = tonumber(ARGV[3])

  local w = math.floor(now / period)
  local field = string.format('%d', w)
  local got = redis.call('HMGET', KEYS[1], field, string.format('%d', w - 1), string.format('%d', w + 1))
  local used = tonumber(got[1] or '0')
  local before = tonumber(got[2] or '0')
  local after = tonumber(got[3] or '0')
  local extra = carry(before, after, w, now, period)

  local allowed = 0
  local retry = 0
  if cost == 0 or used + extra + cost <= limit then
    allowed = 1
    if cost > 0 and apply then
      used = redis.call('HINCRBY', KEYS[1], field, cost)
      -- Forget ended windows once per window, when this call opened one.
      -- Only window counts: the lease script's fields ("h…", "p…", "g…")
      -- are its own to trim.
      if used == cost then
        for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
          local fw = tonumber(f)
          if fw ~= nil and fw < w - 1 then
            redis.call('HDEL', KEYS[1], f)
          end
        end
      end
      local ttl_ms = math.ceil(((w + 2) * period - now) / 1000)
      if redis.call('PTTL', KEYS[1]) < ttl_ms then
        redis.call('PEXPIRE', KEYS[1], ttl_ms)
      end
    end
  elseif cost > limit then
    retry = -1
  elseif used + cost + after > limit then
    -- No room in this window: from the next one on, this window's count is
    -- the one that fades.
    retry = wait_for(cost, 0, used, 0, w + 1, now, period, limit)
  else
    retry = wait_for(cost, used, before, after, w, now, period, limit)
  end

  local reset = reset_after(used, before, w, now, period)
  local remaining = limit - used - extra
  if remaining < 0 then remaining = 0 end
  return {allowed, remaining, reset, retry, now, 0, 0}
end
