-- Slots of a key's in-flight budget, held in leases under an expiry: how
-- the concurrency limiter's holders share at most N in flight (src/concurrency/slots.rs
-- mirrors the arithmetic; a parity test holds them together).
--
-- KEYS[1]  the key's leases: a hash, lease -> "slots expires_ms want"
-- ARGV[1]  N, the most slots in flight across every lease
-- ARGV[2]  how long a lease lasts, ms, from this call
-- ARGV[3]  1: a lease that gets nothing still counts its want for a
--          moment (one per process: hybrid); 0: it is dropped (one per
--          request: exact, whose attempts would pile up)
-- ARGV[4…] pairs: a lease and the slots it wants to hold (absolute)
--
-- Leases past their expiry are dropped: their holder stopped renewing,
-- and its slots are free again. A lease asking for no more than it holds
-- gets what it asks (the rest is released; 0 ends it). A lease that gets
-- nothing is kept, with no slot, for a second: its want counts in the
-- fair shares. A lease asking
-- for more gets what fits beside the others' live slots, and never less
-- than it holds. Every call sets an absolute value, so a second delivery
-- of the same call changes nothing.
-- Returns, per pair, {slots held, fair share}: the fair share is the
-- lease's max-min share of N by every live lease's want, which a holder
-- above it gives back as its requests finish; then the slots of expired
-- leases this call dropped (leaked by a holder that stopped renewing).
-- Complexity: O(pairs × leases), and O(leases log leases) for the fair level.
--
-- Sent with lua/fair_level.lua in front of it, which defines fair_level.
local n = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local keep_waiting = ARGV[3] == '1'
-- How long a want that got nothing counts, ms.
local waiting = 1000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local slots = {}
local wants = {}
local expired = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local held, expires, want = string.match(entries[i + 1], '^(%d+) (%d+) (%d+)$')
  if held == nil or tonumber(expires) <= now then
    redis.call('HDEL', KEYS[1], entries[i])
    if held ~= nil then
      expired = expired + tonumber(held)
    end
  else
    slots[entries[i]] = tonumber(held)
    wants[entries[i]] = tonumber(want)
  end
end

local function total()
  local sum = 0
  for _, held in pairs(slots) do
    sum = sum + held
  end
  return sum
end

local out = {}
for i = 4, #ARGV, 2 do
  local lease = ARGV[i]
  local want = tonumber(ARGV[i + 1])
  local held = slots[lease] or 0
  local new = want
  if want > held then
    new = math.max(held, math.min(want, n - (total() - held)))
  end
  if want <= 0 or (new <= 0 and not keep_waiting) then
    slots[lease] = nil
    wants[lease] = nil
    redis.call('HDEL', KEYS[1], lease)
  else
    -- A lease that got nothing still counts its want for a moment, so
    -- the holders above their fair share give slots back.
    local lasts = ttl
    if new <= 0 then
      lasts = math.min(ttl, waiting)
    end
    slots[lease] = new
    wants[lease] = want
    redis.call('HSET', KEYS[1], lease, string.format('%d %d %d', new, now + lasts, want))
  end
  out[#out + 1] = new
end
local lvl = fair_level(n, wants)
local reply = {}
for i = 4, #ARGV, 2 do
  local want = wants[ARGV[i]] or 0
  reply[#reply + 1] = out[(i - 2) / 2]
  reply[#reply + 1] = math.min(want, lvl)
end
if redis.call('HLEN', KEYS[1]) > 0 and redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
reply[#reply + 1] = expired
return reply
