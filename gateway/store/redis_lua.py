"""Lua scripts of the Redis store: each one is a single atomic step shared by all replicas.

Keys are derived inside the scripts from a prefix (ARGV[1]), so the store targets a
standalone Redis (or one primary), not Redis Cluster. Amounts are integer micro-dollars
passed as strings and stay below 2^53, where Lua's doubles are exact; numbers computed in
Lua are formatted with %d before they reach a command, never in exponent form.
"""

from __future__ import annotations

from typing import Final

_HELPERS: Final = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function neg(s)
  if s == '0' then return '0' end
  return '-' .. s
end
-- Whether a write under a lease must be refused: `lease` ('' = none) is the lease as the
-- writer took it ("epoch owner"); `fence:<id>` holds the last lease taken on the run (no
-- expiry; '0' once released), so a writer whose lease lapsed may go on until someone else
-- takes the run.
local function fenced(p, id, lease)
  return lease ~= '' and redis.call('GET', p .. 'fence:' .. id) ~= lease
end
-- The owner named by a lease key's value ("epoch owner"; before epochs, the owner alone).
local function holder(v)
  if not v then return nil end
  return string.match(v, '^%d+ (.*)$') or v
end
-- Give back `owner`'s lease of a run (its key and fence keys): the key goes, and the fence no
-- longer names that lease (its next one gets a new epoch), also when the lease had lapsed.
local function release_lease(key, fence, owner)
  local cur = redis.call('GET', key)
  if cur and holder(cur) ~= owner then return 0 end
  local last = redis.call('GET', fence)
  if last and last ~= '0' and holder(last) == owner then redis.call('SET', fence, '0') end
  if cur then return redis.call('DEL', key) end
  return 0
end
-- A reservation that ends (settled, released, expired) leaves its run's slots, its owner's set
-- and the calls in flight of its rate scopes ('|team:a|key:b|').
local function unslot(p, rid, run, owner, scopes)
  if run and run ~= '' then redis.call('ZREM', p .. 'slots:' .. run, rid) end
  if owner and owner ~= '' then redis.call('SREM', p .. 'owner:' .. owner, rid) end
  if scopes then
    for scope in string.gmatch(scopes, '[^|]+') do redis.call('ZREM', p .. 'inflight:' .. scope, rid) end
  end
end
-- A token clock `tat` (a string, or false: none yet) pushed by `n` tokens of `per` seconds
-- each, from no earlier than `now` (s).
local function pushed(tat, now, n, per)
  return string.format('%.6f', math.max(tonumber(tat or '0'), now) + tonumber(n) * tonumber(per))
end
-- {spent, reserved, turns or false, cost, in_flight, held, clocks} of a team's period and a
-- run; with `clocks`, the team's own rate clocks (`own_clocks`) are read in the same HMGET.
local function figures(p, team, period, run, now, clocks)
  local ledger = p .. 'ledger:' .. team
  local l
  if clocks then
    l = redis.call('HMGET', ledger, 'spent:' .. period, 'reserved:' .. period, 'rate:r', 'rate:t')
  else
    l = redis.call('HMGET', ledger, 'spent:' .. period, 'reserved:' .. period)
  end
  local spent, reserved = l[1] or '0', l[2] or '0'
  local own = clocks and {l[3], l[4]} or false
  if run == '' then return {spent, reserved, false, '0', 0, 0, own} end
  local r = redis.call('HMGET', p .. 'run:' .. run, 'turns', 'cost')
  local slots = p .. 'slots:' .. run
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', string.format('%d', now))
  local ids = redis.call('ZRANGE', slots, 0, -1)
  local held = 0
  for _, rid in ipairs(ids) do
    held = held + tonumber(redis.call('HGET', p .. 'res:' .. rid, 'amount') or '0')
  end
  return {spent, reserved, r[1] or false, r[2] or '0', #ids, held, own}
end
-- A team's own rate clocks {r, t} as `figures` read them from its ledger, or, when the ledger
-- has none yet, from `rate:team:NAME`, where versions before 2026-12 kept them.
local function own_clocks(p, f, scope)
  if f[7][1] or f[7][2] then return f[7] end
  return redis.call('HMGET', p .. 'rate:' .. scope, 'r', 't')
end
-- A reservation's holds (base.Hold; '|scope#period|scope#period|'): each one's ledger's
-- `reserved` moved by `delta` (micros as a string; '0': left), and with `spent`, that added.
local function holds_moved(p, budgets, delta, spent)
  if not budgets or budgets == '' then return end
  for scope, period in string.gmatch(budgets, '|([^|#]+)#([^|]+)|') do
    local ledger = p .. 'ledger:' .. scope
    if delta ~= '0' then redis.call('HINCRBY', ledger, 'reserved:' .. period, delta) end
    if spent then redis.call('HINCRBY', ledger, 'spent:' .. period, spent) end
  end
end
-- A booking's spend (base.SpendRow): the day's figures of its team and attribution (`attr`,
-- base.Attribution.encoded), in the hash of the day (days since the epoch, UTC).
local function spend(p, team, attr, actual, at_ms)
  local day = string.format('%d', math.floor(at_ms / 86400000))
  local key, field = p .. 'spend:' .. day, team .. '\\31' .. (attr or '')
  redis.call('HINCRBY', key, 'c:' .. field, actual)
  redis.call('HINCRBY', key, 'n:' .. field, 1)
  redis.call('ZADD', p .. 'spend:days', day, day)
end
-- Reservations whose expiry passed: their process is presumed dead, give the money back.
-- The record stays (state expired) for a while so that a late settle still books the spend.
local function reclaim(p, team, now, retention)
  local held = p .. 'held:' .. team
  local ledger = p .. 'ledger:' .. team
  local ids = redis.call('ZRANGEBYSCORE', held, '-inf', string.format('%d', now))
  for _, rid in ipairs(ids) do
    local rk = p .. 'res:' .. rid
    local r = redis.call('HMGET', rk, 'period', 'amount', 'run', 'owner', 'scopes', 'budgets')
    if r[1] then
      redis.call('HINCRBY', ledger, 'reserved:' .. r[1], neg(r[2]))
      holds_moved(p, r[6], neg(r[2]))
      redis.call('HSET', rk, 'state', 'expired')
      redis.call('PEXPIRE', rk, retention)
      unslot(p, rid, r[3], r[4], r[5])
    end
    redis.call('ZREM', held, rid)
  end
end
"""

_TRANSCRIPT: Final = """
-- A run's transcript beside its head (base.RunWrite), as the arguments from ARGV[i]: the
-- messages kept, how many follow, the messages (JSON), the per_turn entries kept, how many
-- follow, the entries ("prompt completion", or JSON with the turn's call ids: base.turn_item),
-- '1' if stored items past those kept must go.
-- Kept in the lists `transcript:<id>` and `per_turn:<id>`, one item each.
local function transcript_end(i)
  local m = tonumber(ARGV[i + 1])
  return i + 5 + m + tonumber(ARGV[i + 3 + m])
end
local function keep(key, n)
  if n == 0 then redis.call('DEL', key) else redis.call('LTRIM', key, 0, n - 1) end
end
local function push(key, first, last)
  for j = first, last, 1000 do  -- unpack has a limit of its own
    redis.call('RPUSH', key, unpack(ARGV, j, math.min(j + 999, last)))
  end
end
local function write_transcript(p, id, i)
  local m = tonumber(ARGV[i + 1])
  local t = tonumber(ARGV[i + 3 + m])
  local mk, tk = p .. 'transcript:' .. id, p .. 'per_turn:' .. id
  if ARGV[i + 4 + m + t] == '1' then
    keep(mk, tonumber(ARGV[i]))
    keep(tk, tonumber(ARGV[i + 2 + m]))
  end
  push(mk, i + 2, i + 1 + m)
  push(tk, i + 4 + m, i + 3 + m + t)
end
-- A stored run as the store reads it back: {body, messages, per_turn} ({} if none).
local function read_run(p, id)
  local body = redis.call('HGET', p .. 'run:' .. id, 'body')
  if not body then return {} end
  return {body, redis.call('LRANGE', p .. 'transcript:' .. id, 0, -1),
          redis.call('LRANGE', p .. 'per_turn:' .. id, 0, -1)}
end
"""

_AUDIT: Final = """
-- The audit entries of a step (gateway.store.audit), chained by the caller after the head it
-- read: ARGV[at] the head's seq the caller chained after ('' when there are no entries),
-- ARGV[at + 1] how many, then (seq, record) pairs, then the last record's hash. `audit_ok`
-- refuses a step whose head moved meanwhile (the caller chains again and retries).
local function audit_ok(p, at)
  if ARGV[at] == '' then return true end
  local head = redis.call('GET', p .. 'audit:head')
  local seq = head and tonumber(string.match(head, '^(%d+)')) or 0
  return seq == tonumber(ARGV[at])
end
local function audit_write(p, at)
  local n = tonumber(ARGV[at + 1])
  if n == 0 then return end
  for i = 0, n - 1 do
    redis.call('ZADD', p .. 'audit', ARGV[at + 2 + 2 * i], ARGV[at + 3 + 2 * i])
  end
  redis.call('SET', p .. 'audit:head', ARGV[at + 2 * n] .. ' ' .. ARGV[at + 2 + 2 * n])
end
"""

_CREATE: Final = _TRANSCRIPT + """
-- Stores a new run from 9 arguments starting at ARGV[i]: id, team, status, created, revision,
-- head, turns, cost, policy (never changed: LIST_RUNS filters on it), then its transcript
-- (_TRANSCRIPT's arguments). Returns 0 (nothing written) if the id is taken, else 1.
local function create(p, i)
  local id, team, status, created = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local key = p .. 'run:' .. id
  if redis.call('EXISTS', key) == 1 then return 0 end
  redis.call('HSET', key, 'revision', ARGV[i + 4], 'status', status, 'team', team, 'body', ARGV[i + 5],
             'turns', ARGV[i + 6], 'cost', ARGV[i + 7], 'policy', ARGV[i + 8])
  redis.call('ZADD', p .. 'runs', created, id)
  redis.call('ZADD', p .. 'runs:team:' .. team, created, id)
  redis.call('ZADD', p .. 'runs:status:' .. status, created, id)
  write_transcript(p, id, i + 9)
  return 1
end
"""

LOAD_RUN: Final = _TRANSCRIPT + """
return read_run(ARGV[1], ARGV[2])
"""

CREATE_RUN: Final = _CREATE + """
return create(ARGV[1], 2)
"""

_SAVE: Final = """
-- Saves a run if its stored revision is `expected`: nil when saved, else what SAVE_RUN returns.
local function save(p, id, expected, new, status, team, body, turns, cost)
  local key = p .. 'run:' .. id
  local cur = redis.call('HMGET', key, 'revision', 'status', 'team')
  if not cur[1] then return {0} end
  if cur[1] ~= expected then return {2, cur[1]} end
  redis.call('HSET', key, 'revision', new, 'status', status, 'team', team, 'body', body, 'turns', turns, 'cost', cost)
  if cur[2] ~= status or cur[3] ~= team then
    local created = redis.call('ZSCORE', p .. 'runs', id)
    redis.call('ZREM', p .. 'runs:status:' .. cur[2], id)
    redis.call('ZADD', p .. 'runs:status:' .. status, created, id)
    redis.call('ZREM', p .. 'runs:team:' .. cur[3], id)
    redis.call('ZADD', p .. 'runs:team:' .. team, created, id)
  end
  return nil
end
"""

# Returns {0} if the run does not exist, {1} when saved, {2, stored_revision} when stale, {4}
# when ARGV[10] names a lease ("epoch owner") that no longer holds the run. The head is
# ARGV[7]; its transcript's change follows from ARGV[11] (_TRANSCRIPT).
SAVE_RUN: Final = _HELPERS + _TRANSCRIPT + _SAVE + """
if fenced(ARGV[1], ARGV[2], ARGV[10]) then return {4} end
local refused = save(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
if refused then return refused end
write_transcript(ARGV[1], ARGV[2], 11)
return {1}
"""

# Walks the smallest applicable index, newest first, filtering; returns id, run, id, run...
# (each run as read_run reads it).
# ARGV[5]: '' (any policy) or '|a|b|', the policies whose runs are wanted (a run stored
# before runs recorded their policy is always wanted).
LIST_RUNS: Final = _TRANSCRIPT + """
local p, team, status, limit, policies = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local idx = p .. 'runs'
if team ~= '' then idx = p .. 'runs:team:' .. team end
if status ~= '' then
  local by_status = p .. 'runs:status:' .. status
  if team == '' or redis.call('ZCARD', by_status) < redis.call('ZCARD', idx) then idx = by_status end
end
local out = {}
local start = 0
while #out < 2 * limit do
  local ids = redis.call('ZREVRANGE', idx, start, start + 199)
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    local r = redis.call('HMGET', p .. 'run:' .. id, 'status', 'team', 'policy')
    if r[1] and (status == '' or r[1] == status) and (team == '' or r[2] == team)
        and (policies == '' or not r[3] or string.find(policies, '|' .. r[3] .. '|', 1, true)) then
      out[#out + 1] = id
      out[#out + 1] = read_run(p, id)
      if #out >= 2 * limit then break end
    end
  end
  start = start + 200
end
return out
"""

# A Claim: checked (run exists, turn cap, calls in flight, run budget, the holds' budgets
# (key, user: after the scopes, below), team budget; '' = no
# such condition; then each rate scope, base.rate_refusal: ARGV[14] the claim's tokens,
# ARGV[15] how many scopes, ARGV[16] the max_in_flight of the claim's own team scope when
# that is all the scope checks (the claim of a call whose request and tokens were taken
# ahead: counted as below, with no scope argument, clocks or reply of its own; '' = none),
# then one argument each, "window s per-request per-token
# max-in-flight scope" ('-': no such limit; one argument rather than five, since the client
# spends more on each argument than the script on splitting it) and held at once. Returns
# {1, clocks, run revision (with a run)} on a grant, clocks one string "now requests_tat
# tokens_tat ..." (epoch s, two per scope, after the claim: one reply element, not two per
# scope, since each costs the client a parse), or {0, refusal, figures..., now, clocks...}
# with requests tat, tokens tat and in flight per scope as checked (ARGV[16]'s scope first).
# A run's first call adds
# the run to store first (CREATE_RUN's arguments) after the scopes: {2, stored run} if
# it exists (the caller goes on with the stored run without a look-up of its own).
#
# The claim's own team scope ('team:' .. team) lives in what the budget check reads and
# writes already: its clocks are fields of the team's ledger hash (`rate:r`, `rate:t`), read
# in the same HMGET as the budget and written in the same HSET as the reservation; its
# calls in flight are the team's live reservations, which `held:<team>` lists already
# (reclaim, above, takes the expired ones out): counted there (ZCARD), they cost no set of
# their own to add to and remove from on every call. Other scopes (a key's) keep their
# clocks in a hash `rate:<scope>` (r, t) and a set `inflight:<scope>`.
ADMIT: Final = _HELPERS + _CREATE + """
local p, team, period, amount, budget, ttl, rid, retention, run, max_turns, max_in_flight, run_budget, owner =
  ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11],
  ARGV[12], ARGV[13]
-- After the scopes: the attribution, how many holds, one argument per hold ("kind budget
-- period scope"). A run's first call: the run (CREATE_RUN's arguments after the holds) is
-- stored first, in this step.
local at = 17 + tonumber(ARGV[15])
local attr, nholds = ARGV[at], tonumber(ARGV[at + 1])
local made = at + 2 + nholds
if #ARGV >= made + 8 and create(p, made) == 0 then return {2, read_run(p, ARGV[made])} end
local now = now_ms()
reclaim(p, team, now, retention)
local hs, tags = {}, ''
for i = at + 2, made - 1 do
  local kind, hb, hp, scope = string.match(ARGV[i], '^(%S+) (%S+) (%S+) (.+)$')
  local l = redis.call('HMGET', p .. 'ledger:' .. scope, 'spent:' .. hp, 'reserved:' .. hp)
  hs[#hs + 1] = {kind, tonumber(hb), hp, scope, l[1] or '0', l[2] or '0'}
  tags = tags .. '|' .. scope .. '#' .. hp .. '|'
end
local own, specs, with_own = 'team:' .. team, {}, false
for i = 17, at - 1 do
  local window, rs, ts, mif, scope = string.match(ARGV[i], '^(%S+) (%S+) (%S+) (%S+) (.+)$')
  if rs == '-' then rs = '' end
  if ts == '-' then ts = '' end
  if mif == '-' then mif = '' end
  specs[#specs + 1] = {scope, tonumber(window), rs, ts, mif}
  if scope == own and (rs ~= '' or ts ~= '') then with_own = true end  -- its clocks: on the ledger
end
local f = figures(p, team, period, run, now, with_own)
local refused = nil
if run ~= '' and not f[3] then refused = 'run_missing'
elseif max_turns ~= '' and tonumber(f[3]) + f[5] >= tonumber(max_turns) then refused = 'max_turns'
elseif max_in_flight ~= '' and f[5] >= tonumber(max_in_flight) then refused = 'busy'
elseif run_budget ~= '' and tonumber(f[4]) + f[6] + amount > tonumber(run_budget) then refused = 'run_budget'
else
  for _, h in ipairs(hs) do
    if tonumber(h[5]) + tonumber(h[6]) + amount > h[2] then
      refused = h[1] .. '_budget'
      break
    end
  end
  if not refused and budget ~= '' and tonumber(f[1]) + tonumber(f[2]) + amount > tonumber(budget) then
    refused = 'team_budget'
  end
end
local tokens, nows, clocks, scopes = tonumber(ARGV[14]), now / 1000, {}, ''
local own_mif, own_inflight = ARGV[16], 0
if own_mif ~= '' then
  own_inflight = redis.call('ZCARD', p .. 'held:' .. team)
  if not refused and own_inflight >= tonumber(own_mif) then refused = 'rate_limit' end
end
for _, spec in ipairs(specs) do
  local scope, window, rs, ts, mif = spec[1], spec[2], spec[3], spec[4], spec[5]
  local c = {false, false}  -- a scope without clocks (max_in_flight alone) reads none
  if rs ~= '' or ts ~= '' then
    c = scope == own and own_clocks(p, f, scope) or redis.call('HMGET', p .. 'rate:' .. scope, 'r', 't')
  end
  local rt, tt, inflight, listed = tonumber(c[1] or '0'), tonumber(c[2] or '0'), 0, false
  if mif ~= '' then
    -- Those still held: reclaim (above) took the team's expired ones out already, so
    -- counting reads a set and writes nothing.
    if scope == own then
      inflight = redis.call('ZCARD', p .. 'held:' .. team)
    else
      inflight = redis.call('ZCOUNT', p .. 'inflight:' .. scope, '(' .. string.format('%d', now), '+inf')
      scopes = scopes .. '|' .. scope .. '|'
      listed = true
    end
  end
  if not refused and ((mif ~= '' and inflight >= tonumber(mif))
      -- 0.000001: base.RATE_SLACK_S
      or (rs ~= '' and math.max(rt, nows) + tonumber(rs) - nows > window + 0.000001)
      or (ts ~= '' and math.max(tt, nows) + tokens * tonumber(ts) - nows > window + 0.000001)) then
    refused = 'rate_limit'
  end
  clocks[#clocks + 1] = {scope, rt, tt, inflight, rs, ts, listed}
end
if refused then
  local out = {0, refused, f[1], f[2], f[3] or '0', f[4], f[5], string.format('%d', f[6]), string.format('%.6f', nows)}
  if own_mif ~= '' then
    out[#out + 1] = '0'
    out[#out + 1] = '0'
    out[#out + 1] = own_inflight
  end
  for _, c in ipairs(clocks) do
    out[#out + 1] = string.format('%.6f', c[2])
    out[#out + 1] = string.format('%.6f', c[3])
    out[#out + 1] = c[4]
  end
  for _, h in ipairs(hs) do  -- the holds' figures last: spent, reserved
    out[#out + 1] = h[5]
    out[#out + 1] = h[6]
  end
  return out
end
local expires = string.format('%d', now + tonumber(ttl))
local shown, own_r, own_t = string.format('%.6f', nows), nil, nil
for _, c in ipairs(clocks) do
  local rt, tt = c[2], c[3]
  if c[5] ~= '' then rt = math.max(rt, nows) + tonumber(c[5]) end
  if c[6] ~= '' then tt = math.max(tt, nows) + tokens * tonumber(c[6]) end
  local r, t = string.format('%.6f', rt), string.format('%.6f', tt)
  if c[1] == own and (c[5] ~= '' or c[6] ~= '') then
    own_r, own_t = r, t
  elseif c[5] ~= '' or c[6] ~= '' then
    redis.call('HSET', p .. 'rate:' .. c[1], 'r', r, 't', t)
  end
  if c[7] then redis.call('ZADD', p .. 'inflight:' .. c[1], expires, rid) end
  shown = shown .. ' ' .. r .. ' ' .. t
end
local out = {1, shown}
redis.call('HSET', p .. 'res:' .. rid, 'team', team, 'period', period, 'amount', ARGV[4], 'state', 'held',
           'run', run, 'owner', owner, 'scopes', scopes, 'budgets', tags, 'attr', attr)
for _, h in ipairs(hs) do redis.call('HINCRBY', p .. 'ledger:' .. h[4], 'reserved:' .. h[3], ARGV[4]) end
redis.call('ZADD', p .. 'held:' .. team, expires, rid)
if own_r then  -- the team's clocks and its reservation in one write of its ledger
  redis.call('HSET', p .. 'ledger:' .. team, 'reserved:' .. period, string.format('%d', tonumber(f[2]) + amount),
             'rate:r', own_r, 'rate:t', own_t)
else
  redis.call('HINCRBY', p .. 'ledger:' .. team, 'reserved:' .. period, ARGV[4])
end
if run ~= '' then
  redis.call('ZADD', p .. 'slots:' .. run, expires, rid)
  out[#out + 1] = redis.call('HGET', p .. 'run:' .. run, 'revision')  -- Grant.run_revision
end
if owner ~= '' then redis.call('SADD', p .. 'owner:' .. owner, rid) end
return out
"""

# ARGV[6..]: holds, "period scope" each: their spent and reserved follow the figures.
FIGURES: Final = _HELPERS + """
local p, team, period, run, retention = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now = now_ms()
reclaim(p, team, now, retention)
local f = figures(p, team, period, run, now)
local out = {f[1], f[2], f[3] or '', f[4], f[5], string.format('%d', f[6])}
for i = 6, #ARGV do
  local hp, scope = string.match(ARGV[i], '^(%S+) (.+)$')
  local l = redis.call('HMGET', p .. 'ledger:' .. scope, 'spent:' .. hp, 'reserved:' .. hp)
  out[#out + 1] = l[1] or '0'
  out[#out + 1] = l[2] or '0'
end
return out
"""

# Pushes back the expiry of held reservations (ARGV[3..]) to now + ttl ms (ARGV[2]).
RENEW: Final = _HELPERS + """
local p, ttl = ARGV[1], tonumber(ARGV[2])
local expires = string.format('%d', now_ms() + ttl)
for i = 3, #ARGV do
  local rid = ARGV[i]
  local r = redis.call('HMGET', p .. 'res:' .. rid, 'team', 'state', 'run', 'scopes')
  if r[1] and r[2] == 'held' then
    redis.call('ZADD', p .. 'held:' .. r[1], 'XX', 'GT', expires, rid)
    if r[3] and r[3] ~= '' then redis.call('ZADD', p .. 'slots:' .. r[3], 'XX', 'GT', expires, rid) end
    if r[4] then
      for scope in string.gmatch(r[4], '[^|]+') do
        redis.call('ZADD', p .. 'inflight:' .. scope, 'XX', 'GT', expires, rid)
      end
    end
  end
end
return 1
"""

_SETTLE: Final = """
-- Books a reservation's actual cost once (an expired one too, while it is remembered), and
-- pushes the token clocks of its scopes by the tokens it used beyond those counted
-- (ARGV[first..last]: one argument each, "tokens seconds-per-token scope") at `at_ms` (the
-- script's clock).
local function settle(p, rid, actual, first, last, at_ms)
  local rk = p .. 'res:' .. rid
  local r = redis.call('HMGET', rk, 'team', 'period', 'amount', 'state', 'run', 'owner', 'scopes', 'budgets', 'attr')
  if not r[1] then return 0 end
  local ledger, now, own, own_n, own_per = p .. 'ledger:' .. r[1], at_ms / 1000, 'team:' .. r[1], nil, nil
  for i = first, last do
    local n, per, scope = string.match(ARGV[i], '^(%S+) (%S+) (.+)$')
    if scope == own then  -- on the ledger (ADMIT): pushed below, in the ledger's one write
      own_n, own_per = n, per
    else
      local key = p .. 'rate:' .. scope
      redis.call('HSET', key, 't', pushed(redis.call('HGET', key, 't'), now, n, per))
    end
  end
  local held = r[4] == 'held'
  if held then redis.call('ZREM', p .. 'held:' .. r[1], rid) end
  if own_n then  -- one read and one write of the ledger instead of two increments
    local l = redis.call('HMGET', ledger, 'reserved:' .. r[2], 'spent:' .. r[2], 'rate:t')
    local tat = l[3] or redis.call('HGET', p .. 'rate:' .. own, 't')  -- clocks of before 2026-12
    local reserved = tonumber(l[1] or '0') - (held and tonumber(r[3]) or 0)
    redis.call('HSET', ledger, 'reserved:' .. r[2], string.format('%d', reserved),
               'spent:' .. r[2], string.format('%d', tonumber(l[2] or '0') + tonumber(actual)),
               'rate:t', pushed(tat, now, own_n, own_per))
  else
    if held then redis.call('HINCRBY', ledger, 'reserved:' .. r[2], neg(r[3])) end
    redis.call('HINCRBY', ledger, 'spent:' .. r[2], actual)
  end
  holds_moved(p, r[8], held and neg(r[3]) or '0', actual)
  spend(p, r[1], r[9], actual, at_ms)
  unslot(p, rid, r[5], r[6], r[7])
  redis.call('DEL', rk)
  return 1
end
"""

# ARGV[4..]: token charges ("tokens seconds-per-token scope"), made once with the settle.
SETTLE: Final = _HELPERS + _SETTLE + """
return settle(ARGV[1], ARGV[2], ARGV[3], 4, #ARGV, now_ms())
"""

# Moves rate clocks (ARGV[2..]: "requests-seconds tokens-seconds scope", 0: leave that one)
# from no earlier than now (Store.push_clocks): a key's in `rate:<scope>`, a team's own on its
# ledger, as ADMIT keeps them (read from `rate:team:NAME` while the ledger has none yet).
PUSH_CLOCKS: Final = _HELPERS + """
local p, now = ARGV[1], now_ms() / 1000
for i = 2, #ARGV do
  local rs, ts, scope = string.match(ARGV[i], '^(%S+) (%S+) (.+)$')
  local key, r, t = p .. 'rate:' .. scope, 'r', 't'
  local c = redis.call('HMGET', key, r, t)
  if string.sub(scope, 1, 5) == 'team:' then  -- both clocks written to the ledger, as ADMIT does
    key, r, t = p .. 'ledger:' .. string.sub(scope, 6), 'rate:r', 'rate:t'
    local own = redis.call('HMGET', key, r, t)
    if own[1] or own[2] then c = own end
  end
  local nr, nt = c[1], c[2]
  if tonumber(rs) ~= 0 then nr = pushed(c[1], now, rs, 1) end
  if tonumber(ts) ~= 0 then nt = pushed(c[2], now, ts, 1) end
  if nr then redis.call('HSET', key, r, nr) end
  if nt then redis.call('HSET', key, t, nt) end
end
return 1
"""

_RELEASE: Final = """
local function release(p, rid)
  local rk = p .. 'res:' .. rid
  local r = redis.call('HMGET', rk, 'team', 'period', 'amount', 'state', 'run', 'owner', 'scopes', 'budgets')
  if not r[1] then return 0 end
  if r[4] == 'held' then
    redis.call('HINCRBY', p .. 'ledger:' .. r[1], 'reserved:' .. r[2], neg(r[3]))
    holds_moved(p, r[8], neg(r[3]))
    redis.call('ZREM', p .. 'held:' .. r[1], rid)
  end
  unslot(p, rid, r[5], r[6], r[7])
  redis.call('DEL', rk)
  return 1
end
"""

RELEASE: Final = _HELPERS + _RELEASE + """
return release(ARGV[1], ARGV[2])
"""

RELEASE_OWNER: Final = _HELPERS + _RELEASE + """
local p, owner = ARGV[1], ARGV[2]
local keep = {}
for i = 3, #ARGV do keep[ARGV[i]] = true end
local n = 0
local kept = {}
for _, rid in ipairs(redis.call('SMEMBERS', p .. 'owner:' .. owner)) do
  if keep[rid] then
    kept[#kept + 1] = rid
  elseif redis.call('HGET', p .. 'res:' .. rid, 'state') == 'held' then
    n = n + release(p, rid)
  end
end
redis.call('DEL', p .. 'owner:' .. owner)
for _, rid in ipairs(kept) do redis.call('SADD', p .. 'owner:' .. owner, rid) end
-- Its leases too: a process's owner name is never live twice, so its previous life's
-- leases are dead and another worker or replica may take those runs at once.
local leases = p .. 'leases-of:' .. owner
for _, key in ipairs(redis.call('SMEMBERS', leases)) do
  release_lease(key, p .. 'fence:' .. string.sub(key, #p + 7), owner)  -- the run's id after '<p>lease:'
end
redis.call('DEL', leases)
-- And the notices it was delivering: due again now (a claimed notice is due at its lease's
-- end; only claimed ones carry an owner).
local due, now = p .. 'outbox:due', now_ms()
for _, id in ipairs(redis.call('ZRANGEBYSCORE', due, string.format('(%d', now), '+inf')) do
  if redis.call('HGET', p .. 'outbox:msg:' .. id, 'owner') == owner then
    redis.call('HSET', p .. 'outbox:msg:' .. id, 'owner', '')
    redis.call('ZADD', due, string.format('%d', now), id)
  end
end
return n
"""

TEAM_SPEND: Final = _HELPERS + """
local p, team, period, retention = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
reclaim(p, team, now_ms(), retention)
local ledger = p .. 'ledger:' .. team
return {redis.call('HGET', ledger, 'spent:' .. period) or '0', redis.call('HGET', ledger, 'reserved:' .. period) or '0'}
"""

_ENQUEUE: Final = """
-- Adds outbox notices, (id, body, period) triples from ARGV[first] on, due now; an id the
-- outbox has is left alone. Returns how many were added.
local function enqueue(p, first, now)
  local added = 0
  for i = first, #ARGV - 2, 3 do
    local key = p .. 'outbox:msg:' .. ARGV[i]
    if redis.call('EXISTS', key) == 0 then
      redis.call('HSET', key, 'body', ARGV[i + 1], 'period', ARGV[i + 2], 'state', 'pending', 'attempts', 0,
                 'owner', '', 'error', '')
      redis.call('ZADD', p .. 'outbox:due', string.format('%d', now), ARGV[i])
      added = added + 1
    end
  end
  return added
end
"""

ENQUEUE: Final = _HELPERS + _ENQUEUE + """
return enqueue(ARGV[1], 2, now_ms())
"""

# A run's trace lines (ARGV[4] of them from ARGV[5]) and the notices they cause, at once;
# with a lease (ARGV[3], '' = none), only while it holds the run (else -1, nothing written).
APPEND_EVENTS: Final = _HELPERS + _ENQUEUE + """
local p, id, n = ARGV[1], ARGV[2], tonumber(ARGV[4])
if fenced(p, id, ARGV[3]) then return -1 end
if n > 0 then redis.call('RPUSH', p .. 'events:' .. id, unpack(ARGV, 5, 4 + n)) end
return enqueue(p, 5 + n, now_ms())
"""

# Up to ARGV[3] due notices, held for ARGV[2] for ARGV[4] ms (their due time pushed past the
# lease): id, body, attempts, id, body, attempts...
CLAIM_NOTICES: Final = _HELPERS + """
local p, owner, limit, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local due = p .. 'outbox:due'
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', string.format('%d', now), 'LIMIT', 0, limit)) do
  local key = p .. 'outbox:msg:' .. id
  local r = redis.call('HMGET', key, 'body', 'attempts')
  if r[1] then
    redis.call('ZADD', due, string.format('%d', now + lease), id)
    redis.call('HSET', key, 'owner', owner)
    out[#out + 1] = id
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
  else
    redis.call('ZREM', due, id)
  end
end
return out
"""

# The outcome of a delivery attempt of notice ARGV[2]: 'sent', 'retry' (due again in ARGV[5]
# ms) or 'failed' (given up), only while it is pending and (ARGV[3] ~= '') held by ARGV[3].
NOTICE_OUTCOME: Final = _HELPERS + """
local p, id, owner, outcome = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local key = p .. 'outbox:msg:' .. id
local r = redis.call('HMGET', key, 'state', 'owner')
if r[1] ~= 'pending' or (owner ~= '' and r[2] ~= owner) then return 0 end
local now = now_ms()
redis.call('HINCRBY', key, 'attempts', 1)
redis.call('HSET', key, 'owner', '', 'error', ARGV[6])
if outcome == 'retry' then
  redis.call('ZADD', p .. 'outbox:due', string.format('%d', now + tonumber(ARGV[5])), id)
  return 1
end
if outcome == 'sent' then redis.call('HSET', key, 'state', 'delivered') else redis.call('HSET', key, 'state', 'failed') end
redis.call('ZREM', p .. 'outbox:due', id)
redis.call('ZADD', p .. 'outbox:done', string.format('%d', now), id)
return 1
"""

# One turn: the run's save (refused as SAVE_RUN refuses, and then nothing is written; its
# transcript's change from ARGV[17], _TRANSCRIPT), its trace events (ARGV[j] of them from
# ARGV[j + 1], j the end of the transcript's arguments) with the outbox notices after them,
# and its booking (settle a reservation, or charge the period); returns
# {1, spent, reserved} of the booking's ledger after it ({1} without a booking). Booking
# flag '2' (if_held): {3} and nothing written unless the reservation is still stored.
# ARGV[16]: the lease the turn is written under ("epoch owner", '' = none): {4} and nothing
# written unless it is still the run's (`fenced`).
# ARGV[j + 1 + n]: how many token charges follow the events (one argument each, as SETTLE's),
# then the step's audit entries (_AUDIT: {-1} and nothing written when the audit head moved),
# then the notices.
COMMIT_TURN: Final = _HELPERS + _TRANSCRIPT + _SAVE + _SETTLE + _ENQUEUE + _AUDIT + """
local p, id = ARGV[1], ARGV[2]
if fenced(p, id, ARGV[16]) then return {4} end
local j = transcript_end(17)
local n = tonumber(ARGV[j])
local charges = j + n + 2
local audit_at = charges + tonumber(ARGV[j + n + 1])
local na = tonumber(ARGV[audit_at + 1])
local notices = audit_at + 2
if na > 0 then notices = notices + 2 * na + 1 end
if not audit_ok(p, audit_at) then return {-1} end
if ARGV[10] == '2' and redis.call('EXISTS', p .. 'res:' .. ARGV[11]) == 0 then return {3} end
local refused = save(p, id, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
if refused then return refused end
write_transcript(p, id, 17)
local book, rid, actual, team, period, retention = ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14], ARGV[15]
if n > 0 then redis.call('RPUSH', p .. 'events:' .. id, unpack(ARGV, j + 1, j + n)) end
local now = now_ms()  -- once: the script is one atomic step
enqueue(p, notices, now)
audit_write(p, audit_at)
if book == '0' then return {1} end
if rid ~= '' then
  settle(p, rid, actual, charges, audit_at - 1, now)
elseif actual ~= '0' then
  redis.call('HINCRBY', p .. 'ledger:' .. team, 'spent:' .. period, actual)
  spend(p, team, '', actual, now)  -- (no reservation: the team's row alone; the commit takes no attribution)
end
reclaim(p, team, now, retention)
local l = redis.call('HMGET', p .. 'ledger:' .. team, 'spent:' .. period, 'reserved:' .. period)
return {1, l[1] or '0', l[2] or '0'}
"""

# The lease key of a run (KEYS[1]) holds "epoch owner" for its TTL: who may take the run.
# Its fence key (KEYS[4]) holds the last lease taken, with no expiry: whose writes count. A
# live lease of `owner` is extended; a free one (no key: never taken, released or expired)
# is taken back with its epoch if `owner` was the last to take it and did not release it (it
# lapsed, nobody took the run meanwhile), else with a new epoch from KEYS[3], a counter of
# every lease taken under the prefix, so epochs never repeat. Returns the epoch, or 0 if
# another owner holds it (a value without an epoch is a lease of a replica from before
# epochs, held until it expires). KEYS[2]: the set of the lease keys `owner` took
# (RELEASE_OWNER frees them after a restart).
ACQUIRE_LEASE: Final = """
local key, owner, ttl = KEYS[1], ARGV[1], ARGV[2]
local cur = redis.call('GET', key)
if cur then
  local epoch, held_by = string.match(cur, '^(%d+) (.*)$')
  if held_by ~= owner then return 0 end
  redis.call('PEXPIRE', key, ttl)
  redis.call('SADD', KEYS[2], key)
  return tonumber(epoch)
end
local last = redis.call('GET', KEYS[4])
local epoch, held_by = false, false
if last then epoch, held_by = string.match(last, '^(%d+) (.*)$') end
if held_by ~= owner then
  epoch = redis.call('INCR', KEYS[3])
  redis.call('SET', KEYS[4], epoch .. ' ' .. owner)
end
redis.call('SET', key, epoch .. ' ' .. owner, 'PX', ttl)
redis.call('SADD', KEYS[2], key)
return tonumber(epoch)
"""

# KEYS[3]: the run's fence key, cleared ('0') with the lease: the next lease has a new epoch.
RELEASE_LEASE: Final = _HELPERS + """
redis.call('SREM', KEYS[2], KEYS[1])
return release_lease(KEYS[1], KEYS[3], ARGV[1])
"""

# Retention, one batch: runs created before `cutoff` (seconds) from `offset` on in the
# creation index; of those not `running` and saved before `cutoff`, deletes the events (and,
# unless events_only, the run and its index entries; an index entry whose run is gone is
# dropped too). Returns {pruned, kept, scanned}: the next batch starts at offset + kept.
PRUNE_RUNS: Final = """
local p, cutoff, offset, batch, events_only = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local ids = redis.call('ZRANGEBYSCORE', p .. 'runs', '-inf', '(' .. cutoff, 'LIMIT', offset, batch)
local pruned, kept = 0, 0
for _, id in ipairs(ids) do
  local key = p .. 'run:' .. id
  local r = redis.call('HMGET', key, 'status', 'team', 'body')
  if not r[3] then
    redis.call('ZREM', p .. 'runs', id)
  elseif r[1] == 'running' then
    kept = kept + 1
  else
    -- the body's last "updated_at" (a head's, or, in a body of before heads, the one after
    -- its transcript), read without decoding what can be megabytes long while Redis waits
    local updated = tonumber(string.match(r[3], '.*"updated_at":([-+.%deE]+)')) or 0
    if updated >= cutoff then
      kept = kept + 1
    elseif events_only == '1' then
      pruned = pruned + redis.call('DEL', p .. 'events:' .. id)
      kept = kept + 1
    else
      redis.call('DEL', key, p .. 'events:' .. id, p .. 'lease:' .. id, p .. 'fence:' .. id,
                 p .. 'transcript:' .. id, p .. 'per_turn:' .. id)
      redis.call('ZREM', p .. 'runs', id)
      redis.call('ZREM', p .. 'runs:team:' .. r[2], id)
      redis.call('ZREM', p .. 'runs:status:' .. r[1], id)
      pruned = pruned + 1
    end
  end
end
return {pruned, kept, #ids}
"""

# --- keys, console sessions, the audit log ---------------------------------------------------


# A key record written whole: ARGV[2] id, [3] team, [4] the expected revision ('' for a new
# key), [5] body, then the audit entries from ARGV[6]. {1, revision, last_used} when written;
# {0} the id is taken; {2} no such key; {3, stored revision} stale; {-1} the audit head moved.
PUT_KEY: Final = _AUDIT + """
local p, id, team, expected, body = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if not audit_ok(p, 6) then return {-1} end
local key = p .. 'key:' .. id
local cur = redis.call('HMGET', key, 'revision', 'last_used')
if expected == '' then
  if cur[1] then return {0} end
else
  if not cur[1] then return {2} end
  if cur[1] ~= expected then return {3, cur[1]} end
end
local rev = redis.call('INCR', p .. 'keys:revision')
redis.call('HSET', key, 'body', body, 'revision', rev, 'team', team)
redis.call('ZADD', p .. 'keys:rev', rev, id)
redis.call('ZADD', p .. 'keys:ids', 0, id)
redis.call('ZADD', p .. 'keys:team:' .. team, 0, id)
audit_write(p, 6)
return {1, rev, cur[2] or ''}
"""

# The keys written after revision ARGV[2]: {last revision, revision, body, last_used, ...}.
_KEY_ROWS: Final = """
-- Each stored key of `ids` as (revision, body, last_used) appended to `out`.
local function key_rows(p, ids, out)
  for _, id in ipairs(ids) do
    local r = redis.call('HMGET', p .. 'key:' .. id, 'revision', 'body', 'last_used')
    if r[2] then
      out[#out + 1] = r[1]
      out[#out + 1] = r[2]
      out[#out + 1] = r[3] or ''
    end
  end
  return out
end
"""

KEYS_SINCE: Final = _KEY_ROWS + """
local p = ARGV[1]
local ids = redis.call('ZRANGEBYSCORE', p .. 'keys:rev', '(' .. ARGV[2], '+inf')
return key_rows(p, ids, {redis.call('GET', p .. 'keys:revision') or '0'})
"""

# Up to ARGV[4] keys after id ARGV[3] ('' from the first), of team ARGV[2] ('': every team):
# {revision, body, last_used, ...} in id order.
LIST_KEYS: Final = _KEY_ROWS + """
local p, team, after, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local index = p .. 'keys:ids'
if team ~= '' then index = p .. 'keys:team:' .. team end
local from = '-'
if after ~= '' then from = '(' .. after end
return key_rows(p, redis.call('ZRANGEBYLEX', index, from, '+', 'LIMIT', 0, limit), {})
"""

# last_used of keys: ARGV[2..] "epoch-seconds id" pairs, never moved back, no revision.
TOUCH_KEYS: Final = """
local p = ARGV[1]
for i = 2, #ARGV do
  local at, id = string.match(ARGV[i], '^(%S+) (.+)$')
  local key = p .. 'key:' .. id
  if redis.call('EXISTS', key) == 1 then
    local cur = tonumber(redis.call('HGET', key, 'last_used') or '0')
    if tonumber(at) > cur then redis.call('HSET', key, 'last_used', at) end
  end
end
return 1
"""

# A console session: ARGV[2] id hash, [3] body, [4] idle until, [5] expires at (ms), then
# the audit entries from ARGV[6]. {1}, or {-1}: the audit head moved.
PUT_SESSION: Final = _AUDIT + """
local p = ARGV[1]
if not audit_ok(p, 6) then return {-1} end
local key = p .. 'session:' .. ARGV[2]
redis.call('HSET', key, 'body', ARGV[3], 'idle_until', ARGV[4])
redis.call('PEXPIREAT', key, ARGV[5])
audit_write(p, 6)
return {1}
"""

# A session ended: ARGV[2] id hash, then the audit entries from ARGV[3]. {1, found} or {-1}.
DELETE_SESSION: Final = _AUDIT + """
local p = ARGV[1]
if not audit_ok(p, 3) then return {-1} end
local found = redis.call('DEL', p .. 'session:' .. ARGV[2])
audit_write(p, 3)
return {1, found}
"""

# Audit entries alone (ARGV[2..], as above): {1} or {-1}.
APPEND_AUDIT: Final = _AUDIT + """
local p = ARGV[1]
if not audit_ok(p, 2) then return {-1} end
audit_write(p, 2)
return {1}
"""

# Retention: records before ARGV[2] (epoch s), oldest first, in batches of ARGV[3], keeping the
# newest; returns how many were removed in this batch.
PRUNE_AUDIT: Final = """
local p, before, batch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local key = p .. 'audit'
local total = redis.call('ZCARD', key)
if total <= 1 then return 0 end
local n = 0
for _, rec in ipairs(redis.call('ZRANGE', key, 0, math.min(batch, total - 1) - 1)) do
  local at = tonumber(string.match(rec, '"at":([-+.%deE]+)'))
  if not at or at >= before then break end
  redis.call('ZREM', key, rec)
  n = n + 1
end
return n
"""

# Spending without a reservation: ARGV[2] team, [3] period, [4] micros, [5] attribution.
CHARGE: Final = _HELPERS + """
local p = ARGV[1]
redis.call('HINCRBY', p .. 'ledger:' .. ARGV[2], 'spent:' .. ARGV[3], ARGV[4])
spend(p, ARGV[2], ARGV[5], ARGV[4], now_ms())
return 1
"""

ANNOUNCE_RELOAD: Final = """
-- One more reload announced to every process sharing the prefix (base.ReloadMark).
-- ARGV: prefix, origin. Returns the new generation.
local k = ARGV[1] .. 'reload'
local g = redis.call('HINCRBY', k, 'generation', 1)
redis.call('HSET', k, 'origin', ARGV[2])
return g
"""
