-- carry_fixed_window.lua: the fixed window's arithmetic for the window scripts.
-- KEYS     none: a fragment, sent in front of window_check.lua and
--          lease_window.lua, whose KEYS it leaves to them.
-- ARGV     none: its functions take their values as arguments.
-- Returns  nothing: it defines carry, wait_for and reset_after (their
--          arguments and answers are in lease_window.lua's header).
-- Complexity: O(1) each.
--
-- Windows are independent:
-- nothing outside the target window counts against it, a full window has
-- room again only when it has ended, and a window not begun yet has room
-- from its start.
local function carry(before, after, target, now, period)
  return 0
end

local function wait_for(n, used, before, after, target, now, period, limit)
  if limit - used - n >= 0 and target * period > now then return target * period - now end
  return (target + 1) * period - now
end

-- The whole limit is free again when the current window ends.
local function reset_after(used, before, current, now, period)
  return (current + 1) * period - now
end

