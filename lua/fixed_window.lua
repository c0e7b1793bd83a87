-- fixed_window.lua: exact fixed-window check-and-count, one call per decision.
--
-- KEYS[1]  hash; field = window index (floor(redis_now_us / period_us)),
--          value = permits counted in that window.
-- ARGV[1]  limit      permits per window (integer >= 1)
-- ARGV[2]  period_us  window length in microseconds (integer >= 1000)
-- ARGV[3]  cost       permits this request takes (integer >= 0; 0 = peek,
--                     always allowed, even when debt pushed the count past
--                     the limit)
--
-- Returns  {allowed (0|1), remaining, reset_after_us, retry_after_us, now_us}
--          retry_after_us is 0 when allowed, -1 when cost > limit (never).
--
-- Time comes from Redis TIME only. Windows older than the previous one are
-- deleted; the key expires one period after the end of its newest window.
-- Complexity: O(1), and once per window O(fields) to forget ended windows.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])

local w = math.floor(now / period)
local field = string.format('%d', w)
local used = tonumber(redis.call('HGET', KEYS[1], field) or '0')
local reset = (w + 1) * period - now

local allowed = 0
local retry = 0
if cost == 0 or used + cost <= limit then
  allowed = 1
  if cost > 0 then
    used = redis.call('HINCRBY', KEYS[1], field, cost)
    -- Forget ended windows once per window, when this call opened one.
    -- Only window counts: the lease script's fields ("h…", "p…") are its
    -- own to trim.
    if used == cost then
      for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
        local fw = tonumber(f)
        if fw ~= nil and fw < w - 1 then
          redis.call('HDEL', KEYS[1], f)
        end
      end
    end
    local ttl_ms = math.ceil((reset + period) / 1000)
    if redis.call('PTTL', KEYS[1]) < ttl_ms then
      redis.call('PEXPIRE', KEYS[1], ttl_ms)
    end
  end
elseif cost > limit then
  retry = -1
else
  retry = reset
end

local remaining = limit - used
if remaining < 0 then remaining = 0 end
return {allowed, remaining, reset, retry, now}
