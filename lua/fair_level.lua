-- fair_level.lua: the max-min fair level of a capacity among claimants, for
-- every script that shares a capacity by demand (src/store/fair.rs mirrors
-- it as `fair::level`; slicelimit::store::fair::LUA carries this text).
-- KEYS     none: a fragment, sent in front of a script (lua/slots.lua,
--          slicelimit-server's rate_share.lua), whose KEYS it leaves to it.
-- ARGV     none: its function takes its values as arguments.
-- Returns  nothing: it defines fair_level(capacity, wants).
--
-- fair_level(capacity, wants): `wants` is a table whose values are the
-- claimants' wants (whole, >= 0; its keys are not read, so a list and a
-- map of name -> want both do; it is not changed). Returns the largest
-- whole L with sum(min(want, L)) <= capacity, or math.huge when every want
-- fits (sum(wants) <= capacity, an empty table included). A claimant's
-- max-min fair share is then math.min(want, L): wants at or under L are
-- met in full, the others get L, what is left shared equally and rounded
-- down. Exact for capacities and wants up to 2^53 (Lua numbers are
-- doubles).
-- Complexity: O(n log n) for n wants.
local function fair_level(capacity, wants)
  local sorted = {}
  for _, want in pairs(wants) do
    sorted[#sorted + 1] = want
  end
  table.sort(sorted)
  local left = capacity
  for i = 1, #sorted do
    local share = math.floor(left / (#sorted - i + 1))
    if sorted[i] > share then
      return share
    end
    left = left - sorted[i]
  end
  return math.huge
end
