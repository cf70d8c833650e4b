"""All of riverbed's Lua, in one place.  Every script touches the keys of one session only,
but ``RENEW_ALL``, which a worker runs only on a standalone Redis (one slot for every key), and
``APPEND`` and ``SANDBOX_USER``, which reach a key of the prefix too on a standalone Redis only.

Replies are arrays whose first element is a status word, decoded by the callers in
``bus/log.py``, ``bus/action_claims.py``, ``bus/leases.py`` and ``bus/archive.py``.
"""

from __future__ import annotations

_CLOCK = """
if redis.replicate_commands then redis.replicate_commands() end
-- The server's time in ms, asked for on the first clock() call only.
local now = nil
local function clock()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end
"""
_NOW = _CLOCK + "clock()\n"
"""The time as ``now``, asked for at once (the scripts that always need it)."""

# KEYS: log, meta, answers, idem, claims, wake (the session's shard channel: ``bus/wakeups.py``),
#       and on a standalone Redis also the runtime, memory and condenser directories, the
#       sessions index, the agent directory and, for a session with a tenant, the tenant's index
#       (other slots: a cluster client announces in a second step instead)
# ARGV: expected_last ('' = any), idem_ttl_ms ('' = no idempotency key), role ('' = not an owner),
#       token, ack_group ('' = none), ack_id ('' = none: the group is named for pass_own only), tenant, n,
#       pass_own (the last id the acking group delivered to the caller, '' = none: see below), session,
#       digest (of the request the idempotency key is bound to, '' = none), then n pairs (payload,
#       answered cause or 0), then wake_agent ('1': the batch opens or cancels a run, so the agent
#       role is announced unless it holds the session or was announced already; the agent role is
#       never announced otherwise)
# Replies: {'ok', first, count, index, need...} | {'dup', first, count, index, need...} | {'conflict', last}
#          | {'fenced', current} | {'answered', cause, existing id} | {'tenant', the session's tenant ('' none)}
#          | {'reused', first}: the idempotency key was used with another digest (nothing appended)
# index 1: the append created the session and the caller adds it to the sessions index; need: the
# roles the caller announces the session to.  With the directories among the KEYS (runtime, memory,
# condenser, then the sessions index, then agent), the script
# does both itself (in the same atomic step as the append) and names neither.
# The first append pins the session's tenant (none is a tenant too); any later append that is not
# a role owner's must name the same one, checked before anything else (a retry included; only a
# conflict with expected_last is told first).
ANNOUNCE_MS = 2000
"""While a role has no owner for a session, appends re-announce it at most this often."""

APPEND = (
    _CLOCK
    + f"local ANNOUNCE_MS = {ANNOUNCE_MS}\n"
    + """
-- clock() only where the time is needed: an append to a session every role owns asks for none.
-- The session's meta in one read: last id, tenant, the role's fence, when each role was announced.
local meta = redis.call('HMGET', KEYS[2], 'last', 'tenant', 'fence:' .. ARGV[3],
  'need:runtime', 'need:memory', 'need:condenser', 'need:agent', 'holder:agent')
local ROLES = {'runtime', 'memory', 'condenser', 'agent'}
local DIRECTORY = {7, 8, 9, 11}  -- the KEYS index of each role's directory (10: the sessions index)
local pinned_last = tonumber(meta[1] or '0')
if ARGV[3] == '' and pinned_last > 0 then
  local pinned = meta[2] or ''
  if pinned ~= ARGV[7] then
    -- A writer that expected another last id hears that first (it says nothing more).
    if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= pinned_last then return {'conflict', pinned_last} end
    return {'tenant', pinned}
  end
end
if ARGV[2] ~= '' then
  local seen = redis.call('GET', KEYS[4])
  if seen then
    -- "first:count", or "first:count:digest" for a key bound to its request's digest
    local sep = string.find(seen, ':')
    local first = tonumber(string.sub(seen, 1, sep - 1))
    local count, digest = string.sub(seen, sep + 1), ''
    local sep2 = string.find(count, ':')
    if sep2 then count, digest = string.sub(count, 1, sep2 - 1), string.sub(count, sep2 + 1) end
    if ARGV[11] ~= '' and digest ~= ARGV[11] then return {'reused', first} end
    -- The first try's announce (shared keys: another node on a cluster) may have failed: announce
    -- again to every role still without an owner, and index the session again if it created it.
    local reply = {'dup', first, tonumber(count), first == 1 and 1 or 0}
    for i, role in ipairs(ROLES) do
      if meta[3 + i] then table.insert(reply, role) end
    end
    return reply
  end
end
local last = pinned_last
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= last then
  return {'conflict', last}
end
if ARGV[3] ~= '' then
  local current = meta[3] or '0'
  if current ~= ARGV[4] then
    return {'fenced', tonumber(current)}
  end
end
local n = tonumber(ARGV[8])
for i = 0, n - 1 do
  local cause = ARGV[13 + 2 * i]
  if cause ~= '0' then
    local existing = redis.call('HGET', KEYS[3], cause)
    if existing then return {'answered', tonumber(cause), tonumber(existing)} end
  end
end
local created = 0
if last == 0 then
  created = 1
  redis.call('HSET', KEYS[2], 'created', clock(), 'need:runtime', 0, 'need:memory', 0, 'need:condenser', 0)
  meta[4], meta[5], meta[6] = '0', '0', '0'
  if ARGV[7] ~= '' then redis.call('HSET', KEYS[2], 'tenant', ARGV[7]) end
end
local first = last + 1
for i = 0, n - 1 do
  last = last + 1
  redis.call('XADD', KEYS[1], last .. '-0', 'e', ARGV[12 + 2 * i])
  local cause = ARGV[13 + 2 * i]
  if cause ~= '0' then
    redis.call('HSET', KEYS[3], cause, last)
    redis.call('HDEL', KEYS[5], cause)  -- answered: its claim has done its job
  end
end
redis.call('HSET', KEYS[2], 'last', last)
if ARGV[12 + 2 * n] == '1' and not meta[7] and (not meta[8] or meta[8] == '') then
  meta[7] = '0'  -- a run opens (or is cancelled) with no agent owner: announce it below
end
if ARGV[2] ~= '' then
  local bound = ARGV[11] ~= '' and (':' .. ARGV[11]) or ''
  redis.call('SET', KEYS[4], first .. ':' .. n .. bound, 'PX', ARGV[2])
end
local wake = tostring(last)  -- published on the session's shard channel: "<last>" or "<last> <role>"
if ARGV[5] ~= '' then
  if ARGV[6] ~= '' then redis.call('XACK', KEYS[1], ARGV[5], ARGV[6]) end
  if ARGV[9] ~= '' and tonumber(ARGV[9]) == first - 1 then
    -- The role has no use for what it appends itself (its answer; the agent role's moves, which
    -- it folds as written), and its group had delivered the whole log before it: move the group
    -- past them instead of delivering them back (a read and an ack saved per append).  A group
    -- that is gone (the stream was deleted under its owner) is left alone: its owner finds that
    -- out on its next read.
    local moved = redis.pcall('XGROUP', 'SETID', KEYS[1], ARGV[5], last .. '-0')
    if type(moved) ~= 'table' or not moved.err then
      wake = wake .. ' ' .. ARGV[5]  -- that role's loop has nothing new to read: no need to wake it
    end
  end
end
redis.call('SPUBLISH', KEYS[6], wake)
local inline = #KEYS > 6
local reply = {'ok', first, n, created}
if inline and created == 1 then
  redis.call('ZADD', KEYS[10], 'NX', clock() / 1000, ARGV[10])
  if KEYS[12] then redis.call('ZADD', KEYS[12], 'NX', clock() / 1000, ARGV[10]) end  -- the tenant's index
  reply[4] = 0
end
for i, role in ipairs(ROLES) do
  -- need:<role> holds when the session was last announced to that role (0: never); announce
  -- again at most every ANNOUNCE_MS while no owner has taken it (an announce may be lost).
  local announced = meta[3 + i]
  if announced and clock() - tonumber(announced) >= ANNOUNCE_MS then
    redis.call('HSET', KEYS[2], 'need:' .. role, now)
    if inline then
      redis.call('XADD', KEYS[DIRECTORY[i]], '*', 's', ARGV[10])
    else
      table.insert(reply, role)
    end
  end
end
return reply
"""
)

# KEYS: meta.  ARGV: role, worker, lease_ms, directory entry id.
# Replies: {token, holder, holder's directory entry, ms left of the holder's lease, tenant, created};
# token 0 when another live worker holds it.  The session's tenant ('' none) and creation stamp come
# with a new token, so the new owner starts without reading the meta hash again.
ACQUIRE = (
    _NOW
    + """
local holder = redis.call('HGET', KEYS[1], 'holder:' .. ARGV[1])
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires:' .. ARGV[1]) or '0')
if holder and holder ~= '' and holder ~= ARGV[2] and expires > now then
  return {0, holder, redis.call('HGET', KEYS[1], 'entry:' .. ARGV[1]) or '', expires - now}
end
local token = redis.call('HINCRBY', KEYS[1], 'fence:' .. ARGV[1], 1)
redis.call('HSET', KEYS[1], 'holder:' .. ARGV[1], ARGV[2], 'expires:' .. ARGV[1], now + tonumber(ARGV[3]),
  'entry:' .. ARGV[1], ARGV[4])
redis.call('HDEL', KEYS[1], 'need:' .. ARGV[1])
local meta = redis.call('HMGET', KEYS[1], 'tenant', 'created')
return {token, ARGV[2], ARGV[4], 0, meta[1] or '', meta[2] or ''}
"""
)

# KEYS: meta.  ARGV: role, worker, token, lease_ms.  Reply: 1 renewed, 0 lost.
RENEW = (
    _NOW
    + """
if redis.call('HGET', KEYS[1], 'holder:' .. ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], 'fence:' .. ARGV[1]) ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'expires:' .. ARGV[1], now + tonumber(ARGV[4]))
return 1
"""
)

# KEYS: the metas of the sessions one worker holds for a role.  ARGV: role, worker, lease_ms, then
# the worker's token for each session.  Reply: per session 1 renewed, 0 lost.  RENEW for many
# sessions in one call, on a standalone Redis (a cluster's sessions are in other slots).
RENEW_ALL = (
    _NOW
    + """
local holder, fence = 'holder:' .. ARGV[1], 'fence:' .. ARGV[1]
local expires, until_ = 'expires:' .. ARGV[1], now + tonumber(ARGV[3])
local out = {}
for i, key in ipairs(KEYS) do
  local got = redis.call('HMGET', key, holder, fence)
  if got[1] == ARGV[2] and got[2] == ARGV[3 + i] then
    redis.call('HSET', key, expires, until_)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# KEYS: meta, claims, answers.  ARGV: role, worker, token, lease_ms, action id, claim, force ('1': claim
# even over another claim, for actions safe to repeat).
# Replies: {'ok'} | {'fenced', current token} | {'answered', existing id} | {'claimed', the other claim}
# The owner's "I start this action now": only the holder with the current token may, only once per
# action and never after an answer.  It pushes the lease forward too, so a peer cannot take the
# session over within a lease of a successful claim (the caller starts the action well before).
CLAIM = (
    _NOW
    + """
local current = redis.call('HGET', KEYS[1], 'fence:' .. ARGV[1]) or '0'
if current ~= ARGV[3] or redis.call('HGET', KEYS[1], 'holder:' .. ARGV[1]) ~= ARGV[2] then
  return {'fenced', tonumber(current)}
end
local existing = redis.call('HGET', KEYS[3], ARGV[5])
if existing then return {'answered', tonumber(existing)} end
local held = redis.call('HGET', KEYS[2], ARGV[5])
if held and held ~= ARGV[6] and ARGV[7] ~= '1' then return {'claimed', held} end
redis.call('HSET', KEYS[2], ARGV[5], ARGV[6])
redis.call('HSET', KEYS[1], 'expires:' .. ARGV[1], now + tonumber(ARGV[4]))
return {'ok'}
"""
)

# KEYS: meta.  ARGV: role, worker, token, park (0 release, 1 park, 2 retire), seen_last.
# Reply: 1 released, 0 not the owner, -1 not parked (or retired) because the log moved past seen_last.
# A parked session is announced again by its next append; a retired one only when an append asks
# for the role (the agent role's, when a run opens: see APPEND).
RELEASE = """
if redis.call('HGET', KEYS[1], 'holder:' .. ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], 'fence:' .. ARGV[1]) ~= ARGV[3] then return 0 end
if ARGV[4] ~= '0' then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
  if last > tonumber(ARGV[5]) then return -1 end
  if ARGV[4] == '1' then
    redis.call('HSET', KEYS[1], 'need:' .. ARGV[1], 0)
  else
    redis.call('HDEL', KEYS[1], 'need:' .. ARGV[1])
  end
end
redis.call('HSET', KEYS[1], 'holder:' .. ARGV[1], '', 'expires:' .. ARGV[1], 0)
return 1
"""

# KEYS: meta, and on a standalone Redis the prefix's counter of sandbox user numbers (another slot).
# ARGV: a number just taken from that counter by the caller (a cluster: ``INCR`` first), or '' to take
# one here.  Reply: the session's number, the one it holds or the new one, now held; negated when the
# session has no log (its meta was lost): nothing is recorded, the caller uses it for this time only.
SANDBOX_USER = """
local held = redis.call('HGET', KEYS[1], 'uid')
if held then return tonumber(held) end
local number = tonumber(ARGV[1] ~= '' and ARGV[1] or redis.call('INCR', KEYS[2]))
if redis.call('HEXISTS', KEYS[1], 'created') == 0 then return -number end
redis.call('HSET', KEYS[1], 'uid', number)
return number
"""

# KEYS: log, meta.  ARGV: to (last archived event id).
# Trims the log to events after ``to`` (exact MINID) and records ``archived_to`` (never lowered);
# refuses to empty the stream (the last event always stays).  Reply: {'ok', trimmed} | {'last', last}
TRIM = """
local to = tonumber(ARGV[1])
local last = tonumber(redis.call('HGET', KEYS[2], 'last') or '0')
if to >= last then return {'last', last} end
local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', (to + 1) .. '-0')
local archived = tonumber(redis.call('HGET', KEYS[2], 'archived_to') or '0')
if to > archived then redis.call('HSET', KEYS[2], 'archived_to', to) end
return {'ok', trimmed}
"""

# KEYS: a token bucket (hash: tokens, at ms).  ARGV: rate (tokens a second), burst (the bucket's size).
# Reply: {1, 0} a token taken | {0, ms until the next token}.  An API key's request rate (``serve/limits.py``):
# the bucket fills at ``rate`` up to ``burst``; a refused request takes nothing.
TAKE_TOKEN = (
    _NOW
    + """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local got = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(got[1] or ARGV[2])
local at = tonumber(got[2] or now)
if now > at then tokens = math.min(burst, tokens + (now - at) * rate / 1000) end
if tokens < 1 then
  return {0, math.ceil((1 - tokens) * 1000 / rate)}
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'at', math.max(now, at))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return {1, 0}
"""
)


# --- tenant quotas (``agent/quotas.py``) --------------------------------------------------------

# KEYS: the quotas hash, the tenant's running hash.  ARGV: tenant, session, now (unix seconds).
# Reply: {1, running} the session holds a slot (it did already, or took a free one) |
# {0, running, max_runs} every slot is taken.  One script: two sessions cannot take the last slot.
TAKE_RUN_SLOT = """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  return {1, redis.call('HLEN', KEYS[2])}
end
local running = redis.call('HLEN', KEYS[2])
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local most = cjson.decode(raw)['max_runs']
  if type(most) == 'number' and running >= most then
    return {0, running, most}
  end
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return {1, running + 1}
"""

# KEYS: the tenant's running hash.  ARGV: sessions.  Reply: how many slots were given back.
RELEASE_RUN_SLOTS = """
return redis.call('HDEL', KEYS[1], unpack(ARGV))
"""

# KEYS: the tenant's tokens hash of today, of yesterday.  ARGV: the run's field, the run's tokens so
# far (a fold of its log), the hashes' time to live (seconds).  A report only raises a run's count
# (a repeat changes nothing); what it adds goes to today's ``_total``; a run counted yesterday adds
# only what it spent since.  Reply: today's total.
COUNT_TOKENS = """
local tokens = tonumber(ARGV[2])
local counted = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or redis.call('HGET', KEYS[2], ARGV[1]) or 0)
if tokens > counted then
  redis.call('HSET', KEYS[1], ARGV[1], tokens)
  local total = redis.call('HINCRBY', KEYS[1], '_total', tokens - counted)
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  return total
end
return tonumber(redis.call('HGET', KEYS[1], '_total') or 0)
"""

# KEYS: the tenant's secrets hash, the secret tenants hash, the secrets' key id string.  ARGV: the
# tenant, the name, the record (JSON), the id of the key it is encrypted under.  A record under
# another key than the one the stored secrets are under is refused, so a process with a stale key
# cannot mix two keys in one store.  Reply: 1 (set), or 0 (another key).
SET_SECRET = """
local kid = redis.call('GET', KEYS[3])
if kid and kid ~= ARGV[4] then
  return 0
end
redis.call('SET', KEYS[3], ARGV[4])
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], '1')
return 1
"""  # noqa: S105  (a script, not a password)

# KEYS: the secrets' key id string, then the tenants' secrets hashes.  ARGV: the old key id, the new
# key id, then per record the number of its hash in KEYS (2 and up), its name, the record read
# (decrypted under the old key), the record re-encrypted under the new key.  All or nothing: when
# the key id or a record changed since they were read, nothing is written.  Reply: records
# rewritten, -1 (a record changed: read again) or -2 (the stored secrets are under another key).
REWRITE_SECRETS = """
local kid = redis.call('GET', KEYS[1])
if kid and kid ~= ARGV[1] then
  return -2
end
for i = 3, #ARGV, 4 do
  if redis.call('HGET', KEYS[tonumber(ARGV[i])], ARGV[i + 1]) ~= ARGV[i + 2] then
    return -1
  end
end
for i = 3, #ARGV, 4 do
  redis.call('HSET', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 3])
end
redis.call('SET', KEYS[1], ARGV[2])
return (#ARGV - 2) / 4
"""

# KEYS: the tenant's secrets hash.  ARGV: the name.  Reply: 1 (removed) or 0 (there was none).
REMOVE_SECRET = """
return redis.call('HDEL', KEYS[1], ARGV[1])
"""  # noqa: S105  (a script, not a password)
