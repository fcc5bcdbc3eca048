local op, P = ARGV[1], ARGV[2]
local now
if ARGV[3] ~= '' then now = tonumber(ARGV[3]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) * 1000000 + tonumber(t[2]) end
local function f(x) return string.format('%.0f', x) end
local function ttl(ms) return f(ms + 60000) end

local function wkeys(d) return P..'w:'..d..':z', P..'w:'..d..':c', P..'w:'..d..':s' end

-- prune the entries expired at now (time <= now - w); returns active sum and newest expiry (0 if none)
local function window(d, w)
  local z, h, s = wkeys(d)
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', f(now - w))
  if #old > 0 then
    local freed = 0
    for _, m in ipairs(old) do
      freed = freed + tonumber(redis.call('HGET', h, m) or 0)
      redis.call('HDEL', h, m)
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', f(now - w))
    redis.call('DECRBY', s, f(freed))
  end
  local top = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if #top == 0 then redis.call('DEL', s, h) return 0, 0 end
  return tonumber(redis.call('GET', s) or 0), tonumber(top[2]) + w
end

-- expiry of the oldest entry at which at least `need` has expired
local function free_at(d, w, need)
  local z, h = wkeys(d)
  local freed, start = 0, 0
  while true do
    local chunk = redis.call('ZRANGE', z, start, start + 127, 'WITHSCORES')
    if #chunk == 0 then return -1 end
    for i = 1, #chunk, 2 do
      freed = freed + tonumber(redis.call('HGET', h, chunk[i]) or 0)
      if freed >= need then return tonumber(chunk[i + 1]) + w end
    end
    start = start + 128
  end
end

if op == 'reserve' then   -- rid ('' = status only), then (d, limit, w, cost)*
  local rid, out, allowed, maxw = ARGV[4], {0, now}, 1, 0
  for i = 5, #ARGV, 4 do
    local d, lim, w, c = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    local s, n = window(d, w)
    local fa = -1
    if s + c > lim then
      allowed = 0
      if c <= lim then fa = free_at(d, w, s + c - lim) end
    end
    for _, v in ipairs({s, n, fa}) do table.insert(out, v) end
  end
  if allowed == 1 and rid ~= '' then
    local rr = P..'rr:'..rid
    for i = 5, #ARGV, 4 do
      local d, w, c = ARGV[i], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
      if c > 0 then
        local z, h, s = wkeys(d)
        redis.call('ZADD', z, f(now), rid)
        redis.call('HSET', h, rid, f(c))
        redis.call('INCRBY', s, f(c))
        for _, k in ipairs({z, h, s}) do redis.call('PEXPIRE', k, ttl(w / 1000)) end
        redis.call('HSET', rr, d, '1')
        if w > maxw then maxw = w end
      end
    end
    if maxw > 0 then redis.call('PEXPIRE', rr, ttl(maxw / 1000)) end
  end
  out[1] = allowed
  return out

elseif op == 'adjust' then   -- rid, then (d, cost)* ; no pairs = release everything
  local rid = ARGV[4]
  local rr = P..'rr:'..rid
  local todo = {}
  if #ARGV == 4 then
    for _, d in ipairs(redis.call('HKEYS', rr)) do table.insert(todo, {d, 0}) end
  else
    for i = 5, #ARGV, 2 do
      if redis.call('HEXISTS', rr, ARGV[i]) == 1 then table.insert(todo, {ARGV[i], tonumber(ARGV[i + 1])}) end
    end
  end
  for _, p in ipairs(todo) do
    local d, new = p[1], p[2]
    local z, h, s = wkeys(d)
    local old = redis.call('HGET', h, rid)
    if old then
      redis.call('INCRBY', s, f(new - tonumber(old)))
      if new == 0 then
        redis.call('HDEL', h, rid); redis.call('ZREM', z, rid); redis.call('HDEL', rr, d)
      else
        redis.call('HSET', h, rid, f(new))
      end
    end
  end
  return 0

elseif op == 'slot' then   -- d, action, sid, max_slots, lease
  local k, action, sid = P..'sl:'..ARGV[4], ARGV[5], ARGV[6]
  if action == 'release' then redis.call('ZREM', k, sid) return 1 end
  redis.call('ZREMRANGEBYSCORE', k, '-inf', f(now))
  if action == 'count' then return redis.call('ZCARD', k) end
  if action == 'acquire' then
    if redis.call('ZCARD', k) >= tonumber(ARGV[7]) then return 0 end
  elseif not redis.call('ZSCORE', k, sid) then   -- renew: lease ran out (and was pruned) or unknown
    return 0
  end
  redis.call('ZADD', k, f(now + tonumber(ARGV[8])), sid)
  local top = redis.call('ZRANGE', k, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', k, ttl((tonumber(top[2]) - now) / 1000))
  return 1

elseif op == 'quota' then   -- rid, then (d, limit, ttl, cost)*
  local rid, out, allowed, rows = ARGV[4], {0, now}, 1, {}
  for i = 5, #ARGV, 4 do
    local v = redis.call('HMGET', P..'q:'..ARGV[i], 'used', 'exp')
    local used, exp = tonumber(v[1] or 0), tonumber(v[2] or 0)
    if exp <= now then used, exp = 0, 0 end
    if used + tonumber(ARGV[i + 3]) > tonumber(ARGV[i + 1]) then allowed = 0 end
    table.insert(rows, {used, exp}); table.insert(out, used); table.insert(out, exp)
  end
  if allowed == 1 then
    local qr, maxe = P..'qr:'..rid, 0
    for j, row in ipairs(rows) do
      local i = 1 + 4 * j
      local d, c = ARGV[i], tonumber(ARGV[i + 3])
      local exp = row[2]
      if exp == 0 then exp = now + tonumber(ARGV[i + 2]) end
      redis.call('HSET', P..'q:'..d, 'used', f(row[1] + c), 'exp', f(exp))
      redis.call('PEXPIRE', P..'q:'..d, ttl((exp - now) / 1000))
      redis.call('HSET', qr, d, f(c)..':'..f(exp))
      if exp > maxe then maxe = exp end
    end
    redis.call('PEXPIRE', qr, ttl((maxe - now) / 1000))
  end
  out[1] = allowed
  return out

elseif op == 'adjust_quota' then   -- rid, mode ('all' cost | 'each' (d, cost)*)
  local qr, want = P..'qr:'..ARGV[4], {}
  if ARGV[5] == 'each' then for i = 6, #ARGV, 2 do want[ARGV[i]] = tonumber(ARGV[i + 1]) end end
  local entries = redis.call('HGETALL', qr)
  for i = 1, #entries, 2 do
    local d = entries[i]
    local cost, exp = string.match(entries[i + 1], '^(%d+):(%d+)$')
    cost, exp = tonumber(cost), tonumber(exp)
    local new = want[d]
    if ARGV[5] == 'all' then new = tonumber(ARGV[6]) end
    local v = redis.call('HMGET', P..'q:'..d, 'used', 'exp')
    if new and exp > now and tonumber(v[2] or 0) == exp then
      redis.call('HSET', P..'q:'..d, 'used', f(math.max(0, tonumber(v[1]) + new - cost)))
      redis.call('HSET', qr, d, f(new)..':'..f(exp))
    end
  end
  return 0

elseif op == 'quota_used' then   -- d
  local v = redis.call('HMGET', P..'q:'..ARGV[4], 'used', 'exp')
  if tonumber(v[2] or 0) <= now then return 0 end
  return tonumber(v[1])
end
return redis.error_reply('unknown limiter op '..op)
