-- check_all.lua: the exact check of several quotas on one key,
-- all-or-nothing, sent after the algorithm's file (which defines check).
-- KEYS[i]  quota i's state (every quota of a key shares its hash tag, so
--          all of them live in one slot).
-- ARGV[1]  n         the number of quotas (= #KEYS)
-- ARGV[2]  width     the arguments each quota takes (the algorithm's ARGV)
-- ARGV[3..] quota i's arguments at 3 + (i - 1) * width
--
-- Returns  n replies of the algorithm, flattened (7 values each): when every
--          quota admits, each is counted and replies as its own script
--          would; when one denies, nothing is written, and each reply is
--          what its quota would have answered (allowed 1 for those that
--          had room, with their remaining as nothing was taken from them).
-- Complexity: n times the algorithm's.
local n = tonumber(ARGV[1])
local width = tonumber(ARGV[2])

local function args(i)
  local a = {}
  for j = 1, width do
    a[j] = ARGV[2 + (i - 1) * width + j]
  end
  return a
end

local replies = {}
local admitted = true
for i = 1, n do
  replies[i] = check({KEYS[i]}, args(i), false)
  if replies[i][1] == 0 then admitted = false end
end
if admitted then
  for i = 1, n do
    replies[i] = check({KEYS[i]}, args(i), true)
  end
end

local out = {}
for i = 1, n do
  for j = 1, 7 do
    out[#out + 1] = replies[i][j]
  end
end
return out
