-- carry_sliding_window.lua: the sliding window's arithmetic for the window scripts.
-- KEYS     none: a fragment, sent in front of window_check.lua and
--          lease_window.lua, whose KEYS it leaves to them.
-- ARGV     none: its functions take their values as arguments.
-- Returns  nothing: it defines carry, wait_for and reset_after (their
--          arguments and answers are in lease_window.lua's header).
-- Complexity: O(1) each.
--
-- The load of window W at time `now` is its own count plus the previous
-- window's, weighted by how much of that window the trailing period still
-- overlaps: count(W) + ceil(count(W-1) * (W*period + period - now) /
-- period) (weight 1 before W starts: a pre-lease of the next window). It
-- is admitted while the load stays within the limit. The weight only
-- falls as time passes, so a load within the limit stays so; what may
-- raise it is the next window, pre-leased by a hybrid process: at the
-- boundary that window's weight for W is 1, so W's count plus the next
-- one's must stay within the limit too. The carry is therefore the larger
-- of the weighted previous count and the next window's count.
-- Rounding: the weighted count is rounded up, so the load is never
-- understated; Rust computes the same doubles in the same order.
local function weight_of(target, now, period)
  local left = (target + 1) * period - now
  if left >= period then return period end
  if left < 0 then return 0 end
  return left
end

local function carry(before, after, target, now, period)
  local weighted = 0
  if before > 0 then
    weighted = math.ceil(before * weight_of(target, now, period) / period)
  end
  return math.max(weighted, after)
end

-- µs from now until n more permits fit in window `target` if nothing
-- else changes: once it has started and the previous window's weight has
-- fallen far enough, or, if its own count (or the next one's) leaves no
-- room, at its end.
local function wait_for(n, used, before, after, target, now, period, limit)
  local room = limit - used - n
  local window_end = (target + 1) * period - now
  local start = math.max(1, target * period - now)
  if room < 0 or room < after then return window_end end
  if before <= room then return start end
  -- ceil(before * left / period) <= room  <=>  left <= room * period / before
  local at = (target + 1) * period - room * period / before
  return math.max(start, math.min(window_end, math.ceil(at - now)))
end

-- The whole limit is free again once nothing counted weighs any more:
-- the end of the next window if this one counted anything, else of this
-- one if the previous did, else now.
local function reset_after(used, before, current, now, period)
  if used > 0 then return (current + 2) * period - now end
  if before > 0 then return (current + 1) * period - now end
  return 0
end
