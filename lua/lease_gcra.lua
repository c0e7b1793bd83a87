-- lease_gcra.lua: lease permits from a GCRA key to one process, and record
-- the permits it admitted on credit.
--
-- KEYS[1]  string; the theoretical arrival time (TAT) in redis_now_us (the
--          same key as gcra.lua).
-- ARGV[1]  limit      permits per period
-- ARGV[2]  period_us  the period in microseconds
-- ARGV[3]  burst      permits that may arrive at once
-- ARGV[4]  want       permits asked for (>= 0)
-- ARGV[5]  share_cap  fraction (0, 1] of the available permits one lease may take
-- ARGV[6]  debt       permits admitted on credit, not yet recorded (>= 0)
-- ARGV[7]  need       the fewest permits the waiting request needs (>= 1)
-- ARGV[8]  patience   when nothing is granted, retry_after says when this
--                     many (>= need) will be available
--
-- Returns  {granted, remaining, 0, reset_after_us (until the TAT),
--          retry_after_us (when nothing was granted: until `patience`
--          permits are available; else 0), now_us, uncovered, 0}
--
-- Leasing n permits advances the TAT by n emission intervals, exactly as n
-- admissions would; debt advances it too, past the tolerance if need be.
-- Complexity: O(1).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local share = tonumber(ARGV[5])
local debt = tonumber(ARGV[6])
local need = tonumber(ARGV[7])
local patience = math.min(math.max(need, tonumber(ARGV[8])), burst)

local interval = period / limit
local tolerance = burst * interval
local tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if tat < now then tat = now end

local function available_at(tat_now)
  return math.floor((tolerance - (tat_now - now)) / interval + 1e-9)
end

local uncovered = 0
if debt > 0 then
  uncovered = math.max(0, debt - math.max(0, available_at(tat)))
  tat = tat + debt * interval
end

local available = math.max(0, available_at(tat))
local granted = 0
if available >= math.min(need, burst) then
  local cap = math.max(need, math.floor(available * share))
  granted = math.min(want, available, cap)
end
tat = tat + granted * interval

if granted > 0 or debt > 0 then
  redis.call('SET', KEYS[1], string.format('%d', math.ceil(tat)), 'PX', math.ceil((tat - now) / 1000) + 1)
end
local retry = 0
if granted == 0 then
  retry = math.max(1, math.ceil(tat + patience * interval - tolerance - now))
end
return {granted, math.max(0, available_at(tat)), 0, math.ceil(tat - now), retry, now, uncovered, 0}
