-- check_one.lua: the exact check of one quota, sent after the algorithm's
-- file (window_check.lua, token_bucket.lua or gcra.lua), which defines
-- check and documents its keys, arguments and reply.
-- KEYS     as the algorithm's file: KEYS[1], the key's state.
-- ARGV     as the algorithm's file.
-- Returns  the algorithm's reply: {allowed, remaining, reset_after_us,
--          retry_after_us, now_us, level, given_back}.
return check(KEYS, ARGV, true)
