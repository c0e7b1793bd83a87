-- lease_window.lua: lease a slice of a window budget (fixed or sliding
-- window) to one process, and record the permits it admitted on credit.
-- KEYS[1]  hash; field = window index, value = permits granted or admitted
--          in that window (the same key as window_check.lua).
-- KEYS[2]  optional, only when debt > 0: the report's identity (a string key
--          in the same hash slot). A second delivery of the same report
--          finds it and does not record the debt again; it still leases.
-- ARGV[1]  limit        permits per window (per trailing period: sliding)
-- ARGV[2]  period_us    window length in microseconds
-- ARGV[3]  want         permits asked for (>= 0)
-- ARGV[4]  share_cap    fraction (0, 1] of what remains that one lease may take
-- ARGV[5]  debt         permits admitted on credit, not yet recorded (>= 0)
-- ARGV[6]  debt_window  the window index the debt was admitted in, or -1
--                       when the process did not know it (charged to the
--                       current window)
-- ARGV[7]  min_window   lease from window max(current, min_window), but at
--                       most the next one: a process that knows its window
--                       is ending asks for the next (a pre-lease, granted
--                       now, usable from that window's start), whichever
--                       side of the boundary Redis is on; -1: the current
-- ARGV[8]  tail         remainders up to this size are granted whole
-- ARGV[9]  holder       the asking process's identity (for the fair share)
-- ARGV[10] ceiling      the most this process takes in one lease (>= want):
--                       what it can use, by its rate, before the window ends
-- ARGV[11] lease_id     this lease's identity among the holder's, or 0. The
--                       holder's last grant is kept ("g<holder>" = "id granted
--                       total window", total: all it got in that window); a call carrying the same id again (its
--                       reply was lost) gets that grant back, not a new one,
--                       while its window is current or ahead.
-- ARGV[12] ahead_cap    a lease of the next window taken ahead of need by a
--                       thin holder (a few permits a window): granted only
--                       while the current window's count, the next
--                       window's count, and every holder's ask stay within
--                       this many; refused, it records nothing; 0: no such
--                       cap
-- ARGV[13] cost         the waiting request's cost (>= 1; default 1): a
--                       retry_after is until that many fit
--
-- Returns  {granted, remaining (what the target window's load leaves after
--          this grant), start_after_us (0, or until the target window starts),
--          reset_after_us (until the target window ends), retry_after_us
--          (when nothing was granted: until a permit fits, by wait_for, in
--          the target window or, if its own count leaves no room, from the
--          next one on; else 0),
--          now_us, uncovered (debt permits beyond the limit), window (index
--          of the target window), 0, 0} (the last two are the bucket
--          scripts' level and give-back count)
--
-- Sent with a carry file in front of it (lua/carry_fixed_window.lua or
-- lua/carry_sliding_window.lua), which defines
--   carry(before, after, target, now, period): permits outside
--     the target window that count against it (`before`, `after`: the
--     counts of the windows either side of it);
--   wait_for(n, used, before, after, target, now, period, limit):
--     µs until n more permits fit in the target window, all else equal;
--   reset_after(used, before, current, now, period): µs until the whole
--     limit is free again (window_check.lua's answer).
-- The fixed window carries nothing; the sliding window carries the
-- previous window's weighted count (see its file).
--
-- Sizing. by_rate = min(want, max(1, floor(share_cap * available),
-- min(available, tail))): leases shrink as the window fills and few permits
-- strand in other processes, while the last `tail` permits go in one lease
-- rather than in a trickle of ever smaller ones. by_headroom is a fair share
-- of what remains: the key counts the processes that leased it in this
-- window ("h<window>", every process that asked) and the last ("p<holder>" =
-- the last window a holder asked in); a holder's first lease in the window gets available divided
-- by the holders expected and not yet served, a later one available divided
-- by all holders, both at most `ceiling` and, except for the last holder
-- expected (which takes what is left), share_cap * available; a later one
-- at least what the holder is short of limit / holders in this window
-- (fixed window, when its last grant is recorded).
-- grant = min(available, max(by_rate, by_headroom)): a key far under its
-- limit is served in about one lease per process per window, a key near it
-- in leases that shrink toward one permit, so strict stays exact.
-- Debt is always recorded, even past the limit: the count then
-- shows the true overshoot, and `uncovered` is this report's share of it.
-- Debt for a window older than the previous one can no longer be checked and
-- is returned as wholly uncovered. Time comes from Redis TIME only.
-- Complexity: O(1), and once per window O(fields) to forget ended windows
-- (three windows, two holder counts and two fields per holder process).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local share = tonumber(ARGV[4])
local debt = tonumber(ARGV[5])
local debt_window = tonumber(ARGV[6])
local min_window = tonumber(ARGV[7])
local tail = tonumber(ARGV[8] or '1')
local holder = ARGV[9]
local ceiling = tonumber(ARGV[10] or '0')
local lease_id = ARGV[11] or '0'
local ahead_cap = tonumber(ARGV[12] or '0')
local cost = math.max(1, tonumber(ARGV[13] or '1'))

local w = math.floor(now / period)
if debt_window < 0 then debt_window = w end
local newest = w
local uncovered = 0
-- A window field was created: the key's TTL may need to grow.
local created = false
if debt > 0 and KEYS[2] then
  local seen = redis.call('GET', KEYS[2])
  if seen then
    uncovered = tonumber(seen)
    debt = 0
  end
end
local reported = debt
if debt > 0 then
  if debt_window >= w - 1 and debt_window <= w + 1 then
    local f = string.format('%d', debt_window)
    local near = redis.call('HMGET', KEYS[1], f, string.format('%d', debt_window - 1),
      string.format('%d', debt_window + 1))
    local extra = carry(tonumber(near[2] or '0'), tonumber(near[3] or '0'), debt_window, now, period)
    local before = tonumber(near[1] or '0')
    local after = redis.call('HINCRBY', KEYS[1], f, debt)
    if before == 0 then created = true end
    uncovered = math.max(0, after + extra - limit) - math.max(0, before + extra - limit)
    if debt_window > newest then newest = debt_window end
  else
    uncovered = debt
  end
end

local tw = math.min(math.max(w, min_window), w + 1)
local tf = string.format('%d', tw)
local has_holder = holder ~= nil and holder ~= '' and want > 0
local recorded = has_holder and lease_id ~= '0'
-- One read for every field this call may need (fewer calls into Redis
-- are most of a script's cost): the target window's count, the holder's
-- last window and last grant, the holder counts of this window and the
-- one before.
local pf = 'p' .. (holder or '')
local gf = 'g' .. (holder or '')
local hf = 'h' .. tf
local got = redis.call('HMGET', KEYS[1], tf, pf, gf, hf, 'h' .. string.format('%d', tw - 1),
  string.format('%d', tw - 1), string.format('%d', tw + 1))
local used = tonumber(got[1] or '0')
local before_n = tonumber(got[6] or '0')
local after_n = tonumber(got[7] or '0')
local replayed = false
local granted = 0
-- The holder's last grant: "id granted total window", total being all it
-- was granted in that window.
local g_id, g_granted, g_total, g_window
if got[3] then
  g_id, g_granted, g_total, g_window = string.match(got[3], '^(%d+) (%d+) (%d+) (-?%d+)$')
end
if recorded and g_id == lease_id and tonumber(g_window) >= w then
  -- A second delivery: the first one's grant, not another.
  replayed = true
  granted = tonumber(g_granted)
  if tonumber(g_window) ~= tw then
    tw = tonumber(g_window)
    tf = string.format('%d', tw)
    local near = redis.call('HMGET', KEYS[1], tf, string.format('%d', tw - 1), string.format('%d', tw + 1))
    used = tonumber(near[1] or '0')
    before_n = tonumber(near[2] or '0')
    after_n = tonumber(near[3] or '0')
  end
end
-- What outside the target window counts against it: its count is
-- `used`, its load `used + extra`.
local extra = carry(before_n, after_n, tw, now, period)
local available = math.max(0, limit - used - extra)
-- The share of what remains one lease may take (mirrored by `share_of`
-- in src/algorithm/window.rs; the parity tests hold the two together).
-- At most share_cap of it, or the last `tail` permits whole. With a
-- holder (`joined`: its first ask in the window; `here`, `expected`: the
-- holders that asked in it, and the most expected; `mine`: what it was
-- granted of it), at least its fair share among the holders expected, at
-- most its ceiling.
local function share_of(available, extra, has_holder, joined, here, expected, mine)
  local cap = math.max(1, math.floor(available * share), math.min(available, tail))
  local granted = math.min(want, available, cap)
  if not has_holder then return granted end
  local fair
  -- The last holder expected takes the rest of its share whole: capping
  -- it at share_cap would leave a remainder for a trickle of small leases.
  local last_expected = false
  -- What this holder is still short of its share of the window.
  local entitled = 0
  if joined then
    fair = math.floor(available / math.max(1, expected - here))
    last_expected = expected - here == 1
  else
    fair = math.floor(available / math.max(1, expected))
    -- A holder asking again before it had its share of the whole window
    -- (limit / expected) may take what it is short of: without it, every
    -- holder of a key over its limit took a quarter of what was left,
    -- round after round (a trickle of calls in a window whose holders
    -- were not known at its start). Not where a carry counts: the
    -- window's budget then moves.
    if extra == 0 then
      entitled = math.max(0, math.floor(limit / math.max(1, expected)) - mine)
    end
  end
  -- Many holders: the rate's lease is cut to one holder's share, so thin
  -- processes do not strand what the others wait for. (A remainder of at
  -- most `tail` permits still goes whole to a process that can use it:
  -- its ceiling says how many it spends before the window ends.)
  local whole = 0
  if available <= tail then whole = math.min(available, ceiling) end
  granted = math.min(granted, math.max(1, fair, whole))
  if not last_expected then fair = math.min(fair, math.floor(available * share)) end
  fair = math.max(fair, math.min(entitled, available))
  fair = math.min(fair, ceiling)
  if fair > granted then granted = math.min(fair, available) end
  return granted
end

local first_in_window = false
if not replayed then
  local joined, here, expected, mine = false, 0, 0, 0
  if has_holder then
    joined = tonumber(got[2] or '-1') < tw
    here = tonumber(got[4] or '0')
    expected = math.max(here, tonumber(got[5] or '0'))
    if g_window and tonumber(g_window) == tw then mine = tonumber(g_total) end
    first_in_window = joined
  end
  granted = share_of(available, extra, has_holder, joined, here, expected, mine)
end
-- A thin holder's pre-lease: only while the key is far under its limit
-- (the current window's count within the cap) and every holder's
-- pre-lease would fit within the cap. Near the limit, what a thousand thin
-- holders took ahead of need would strand where others are short; far
-- under it, nobody is. (The count is not projected to the window's end:
-- most of a thin key's count is its holders' pre-leases, granted before
-- the window began, and projecting them refused most pre-leases.)
if not replayed and ahead_cap > 0 and tw > w then
  local holders = math.max(tonumber(got[4] or '0'), tonumber(got[5] or '0'), 1)
  if before_n > ahead_cap or holders * want > ahead_cap then
    granted = 0
  else
    granted = math.max(0, math.min(granted, ahead_cap - used - extra))
  end
  -- Refused, the ask is not a holder of the next window: it may never
  -- ask for it.
  if granted == 0 then first_in_window = false end
end
-- Every write of this call in one HSET (each call into Redis costs more
-- than the Lua around it). The script runs atomically, so setting a count
-- read above plus what this call adds is an increment.
local fresh = granted > 0 and not replayed
local writes = {}
if first_in_window then
  -- Every process that asks counts as a holder, granted or not: a fleet
  -- of a thousand thin processes shares the budget a thousand ways.
  writes[#writes + 1] = hf
  writes[#writes + 1] = string.format('%d', tonumber(got[4] or '0') + 1)
  writes[#writes + 1] = pf
  writes[#writes + 1] = tf
end
if fresh then
  used = used + granted
  writes[#writes + 1] = tf
  writes[#writes + 1] = string.format('%d', used)
  if tw > newest then newest = tw end
  if recorded then
    local total = granted
    if g_window and tonumber(g_window) == tw then total = total + tonumber(g_total) end
    writes[#writes + 1] = gf
    writes[#writes + 1] = lease_id .. ' ' .. string.format('%d', granted) .. ' '
      .. string.format('%d', total) .. ' ' .. tf
  end
end
if #writes > 0 then
  redis.call('HSET', KEYS[1], unpack(writes))
end

if fresh or debt > 0 then
  -- Forget ended windows once per window: when this call opened one (and
  -- the key holds more than one window's fields).
  if fresh and used == granted and redis.call('HLEN', KEYS[1]) > 4 then
    local all = redis.call('HGETALL', KEYS[1])
    local dead = {}
    for i = 1, #all, 2 do
      local f = all[i]
      local c = string.sub(f, 1, 1)
      local fw
      if c == 'h' then
        fw = tonumber(string.sub(f, 2))
      elseif c == 'p' then
        fw = tonumber(all[i + 1])
      elseif c == 'g' then
        fw = tonumber(string.match(all[i + 1], ' (-?%d+)$'))
      else
        fw = tonumber(f)
      end
      if fw == nil or fw < w - 1 then dead[#dead + 1] = f end
    end
    if #dead > 0 then redis.call('HDEL', KEYS[1], unpack(dead)) end
  end
  -- The TTL outlives the newest window counted by one period; it only
  -- has to grow when a window's count was created. (A holder's fields
  -- belong to a window whose count exists: a first ask that is granted
  -- nothing finds the window full.)
  if created or (fresh and used == granted) then
    local ttl_ms = math.ceil(((newest + 2) * period - now) / 1000)
    if redis.call('PTTL', KEYS[1]) < ttl_ms then
      redis.call('PEXPIRE', KEYS[1], ttl_ms)
    end
  end
end

if reported > 0 and KEYS[2] then
  redis.call('SET', KEYS[2], string.format('%d', uncovered), 'PX', 60000)
end

local start_after = tw * period - now
if start_after < 0 then start_after = 0 end
local reset = (tw + 1) * period - now
local retry = 0
if granted == 0 then
  if used + cost + after_n > limit then
    -- No room in the target window itself: from the next one on, its
    -- count is the one that fades (window_check.lua's rule), and what
    -- the next one holds already (pre-leased) is its own count.
    retry = wait_for(cost, after_n, used, 0, tw + 1, now, period, limit)
  else
    retry = wait_for(cost, used, before_n, after_n, tw, now, period, limit)
  end
end
return {granted, math.max(0, limit - used - extra), start_after, reset, retry, now, uncovered, tw, 0, 0}
