-- A holder's share of a rate, held under an expiry: how the replicas of
-- slicelimit-server divide an RLQS bucket's rate (src/share.rs mirrors
-- the arithmetic; a parity test holds them together).
--
-- KEYS[1]  the bucket's holders: a hash, holder ->
--          "held tokens expires_ms tokens_expires_ms claims_until_ms claims"
-- ARGV[1]  this holder's name
-- ARGV[2]  its clients' claims (requests per period, whole), comma-separated
-- ARGV[3]  the bucket's limit (requests per period)
-- ARGV[4]  how long the hold lasts, ms; 0 lets go of it
-- ARGV[5]  what this holder's clients may still be using (at most what it
--          held before): it keeps at least that until it says otherwise
-- ARGV[6]  how long the part of the hold that is tokens lasts, ms
-- ARGV[7]  how long its claims count, ms
-- ARGV[8]  of the hold, the most that is tokens
--
-- A hold counts its rate part until its expiry and its tokens until
-- theirs; it is dropped when both have passed. Claims count until their
-- own (earlier) expiry. The limit is shared max-min fair among every
-- counted claim; this holder's target is what its own clients get, it is
-- granted min(target, limit - what the others hold) and holds
-- max(grant, in use), so the holds never sum past the limit. A second
-- delivery of the same call finds the same holders and grants the same.
-- Returns {grant, held, other holders, 1 if it still had its hold}.
-- Complexity: O(holders + claims), and O(claims log claims) for the fair
-- level.
--
-- Sent with the library's lua/fair_level.lua in front of it
-- (slicelimit::store::fair::LUA), which defines fair_level.
local holder = ARGV[1]
local limit = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local in_use = tonumber(ARGV[5])
local tokens_ttl = math.max(tonumber(ARGV[6]), ttl)
local claims_ttl = math.min(tonumber(ARGV[7]), ttl)
local tokens = tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local own = {}
local claims = {}
for c in string.gmatch(ARGV[2], '%d+') do
  own[#own + 1] = tonumber(c)
  claims[#claims + 1] = tonumber(c)
end
local entries = redis.call('HGETALL', KEYS[1])
local others_held = 0
local others = 0
local had = 0
for i = 1, #entries, 2 do
  local held, tok, expires, tok_expires, claims_until, list = string.match(entries[i + 1],
    '^(%d+) (%d+) (%d+) (%d+) (%d+) ?([%d,]*)$')
  if held == nil or tonumber(tok_expires) <= now then
    redis.call('HDEL', KEYS[1], entries[i])
  elseif entries[i] == holder then
    had = 1
  else
    others = others + 1
    if tonumber(expires) > now then
      others_held = others_held + tonumber(held) - tonumber(tok)
    end
    others_held = others_held + tonumber(tok)
    if tonumber(claims_until) > now then
      for c in string.gmatch(list, '%d+') do
        claims[#claims + 1] = tonumber(c)
      end
    end
  end
end
if ttl <= 0 then
  redis.call('HDEL', KEYS[1], holder)
  return {0, 0, others, had}
end

-- Every counted claim's max-min share of the limit; this holder's target
-- is its own clients' shares.
local level = fair_level(limit, claims)
local target = 0
for i = 1, #own do
  target = target + math.min(own[i], level)
end
local grant = math.min(target, limit - others_held)
if grant < 0 then
  grant = 0
end
local held = math.max(grant, in_use)
redis.call('HSET', KEYS[1], holder, string.format('%d %d %d %d %d %s', held,
  math.min(tokens, held), now + ttl, now + tokens_ttl, now + claims_ttl,
  table.concat(own, ',')))
if redis.call('PTTL', KEYS[1]) < tokens_ttl then
  redis.call('PEXPIRE', KEYS[1], tokens_ttl)
end
return {grant, held, others, had}
