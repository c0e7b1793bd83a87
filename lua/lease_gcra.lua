-- lease_gcra.lua: lease permits from a GCRA key to one process, and record
-- the permits it admitted on credit.
--
-- KEYS[1]  hash; "t" the theoretical arrival time (TAT) in redis_now_us,
--          "gb" permits given back so far (the same key as gcra.lua).
-- KEYS[2]  optional, only when debt > 0: the report's identity (a string key
--          in the same hash slot); a second delivery records no debt again.
-- ARGV[1]  limit      permits per period
-- ARGV[2]  period_us  the period in microseconds
-- ARGV[3]  burst      permits that may arrive at once
-- ARGV[4]  want       permits asked for (>= 0)
-- ARGV[5]  share_cap  fraction (0, 1] of the available permits one lease may take
-- ARGV[6]  debt       permits admitted on credit, not yet recorded (>= 0)
-- ARGV[7]  need       the fewest permits the waiting request needs (>= 1)
-- ARGV[8]  ceiling    the most this process takes in one lease: leases are
--                     at least min(ceiling, share_cap * available)
--
-- Returns  {granted, remaining, 0, reset_after_us (until the TAT),
--          retry_after_us (when nothing was granted: until the
--          `need` permits are available; else 0), now_us, uncovered, 0, level
--          (permits available after the grant, in thousandths, rounded up), given_back}
--
-- Leasing n permits advances the TAT by n emission intervals, exactly as n
-- admissions would; debt advances it too, past the tolerance if need be,
-- but at most one burst beyond it (the rest is counted in `uncovered`).
-- `now_us`, `level` and `given_back` are the lease's origin (give_back.lua).
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
local ceiling = tonumber(ARGV[8] or '0')

local interval = period / limit
local tolerance = burst * interval
local state = redis.call('HMGET', KEYS[1], 't', 'gb')
local tat = tonumber(state[1]) or 0
local gb = tonumber(state[2])
if tat < now then tat = now end

local function level_at(tat_now)
  return (tolerance - (tat_now - now)) / interval
end
local function available_at(tat_now)
  return math.floor(level_at(tat_now) + 1e-9)
end

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
  uncovered = math.max(0, debt - math.max(0, available_at(tat)))
  tat = math.min(tat + debt * interval, now + 2 * tolerance)
end

local available = math.max(0, available_at(tat))
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
tat = tat + granted * interval

if granted > 0 or debt > 0 then
  if gb == nil then gb = now end
  redis.call('HSET', KEYS[1], 't', string.format('%d', math.ceil(tat)), 'gb', string.format('%d', gb))
  redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil((tat - now) / 1000) + 1))
end
if reported > 0 and KEYS[2] then
  redis.call('SET', KEYS[2], string.format('%d', uncovered), 'PX', 60000)
end
local retry = 0
if granted == 0 then
  retry = math.max(1, math.ceil(tat + math.min(need, burst) * interval - tolerance - now))
end
return {granted, math.max(0, available_at(tat)), 0, math.ceil(tat - now), retry, now, uncovered, 0,
  math.ceil((level_at(tat) - 1e-9) * 1000), gb or 0}
