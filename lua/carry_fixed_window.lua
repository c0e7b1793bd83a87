-- carry_fixed_window.lua: the fixed window's part of lease_window.lua,
-- sent in front of it. Windows are independent: nothing outside the
-- target window counts against it, and a full window has room again only
-- when it has ended.
local function carry(before, after, target, now, period)
  return 0
end

local function wait_for(n, used, before, after, target, now, period, limit)
  return (target + 1) * period - now
end

