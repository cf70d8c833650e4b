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
#       never announced otherwise), then wake_runtime ('1': the batch holds an action the runtime
#       role runs, an approval, or a fork whose sandbox it builds: ``log.wakes_runtime``; likewise
#       the only way the runtime role is announced; 'r': it holds none, but one the runtime role's
#       owner hears of all the same); the wake-up of any other append tells the runtime role's
#       loops to sleep on (see ``bus/wakeups.py``)
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
  'need:runtime', 'need:memory', 'need:condenser', 'need:agent', 'holder:agent', 'holder:runtime')
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
  redis.call('HSET', KEYS[2], 'created', clock(), 'need:memory', 0, 'need:condenser', 0)
  meta[5], meta[6] = '0', '0'
  if ARGV[7] ~= '' then redis.call('HSET', KEYS[2], 'tenant', ARGV[7]) end
end
local first = last + 1
-- Each new id is made text once: Lua writes a number as text with a floating-point printf, and
-- the id is written up to five times (each is 1% of a round trip's Redis instructions).
local first_text, last_text
for i = 0, n - 1 do
  last = last + 1
  last_text = string.format('%d', last)
  first_text = first_text or last_text
  redis.call('XADD', KEYS[1], last_text .. '-0', 'e', ARGV[12 + 2 * i])
  local cause = ARGV[13 + 2 * i]
  if cause ~= '0' then
    redis.call('HSET', KEYS[3], cause, last_text)
    redis.call('HDEL', KEYS[5], cause)  -- answered: its claim has done its job
  end
end
if n == 0 then first_text, last_text = string.format('%d', first), string.format('%d', last) end
redis.call('HSET', KEYS[2], 'last', last_text)
if ARGV[12 + 2 * n] == '1' and not meta[7] and (not meta[8] or meta[8] == '') then
  meta[7] = '0'  -- a run opens (or is cancelled) with no agent owner: announce it below
end
if ARGV[13 + 2 * n] == '1' and not meta[4] and (not meta[9] or meta[9] == '') then
  meta[4] = '0'  -- an action for the runtime role, which holds the session nowhere: announce it below
end
if ARGV[2] ~= '' then
  local bound = ARGV[11] ~= '' and (':' .. ARGV[11]) or ''
  redis.call('SET', KEYS[4], first_text .. ':' .. ARGV[8] .. bound, 'PX', ARGV[2])
end
-- Published on the session's shard channel: "<last>", then the roles whose loops have nothing to
-- read in it ("<last> agent runtime"): the runtime role reads only for what it acts on.
local wake = last_text
local skip_runtime = ARGV[13 + 2 * n] == ''
if ARGV[5] ~= '' then
  if ARGV[6] ~= '' then redis.call('XACK', KEYS[1], ARGV[5], ARGV[6]) end
  if ARGV[9] ~= '' and tonumber(ARGV[9]) == first - 1 then
    -- The role has no use for what it appends itself (its answer; the agent role's moves, which
    -- it folds as written), and its group had delivered the whole log before it: move the group
    -- past them instead of delivering them back (a read and an ack saved per append).  A group
    -- that is gone (the stream was deleted under its owner) is left alone: its owner finds that
    -- out on its next read.
    local moved = redis.pcall('XGROUP', 'SETID', KEYS[1], ARGV[5], last_text .. '-0')
    if type(moved) ~= 'table' or not moved.err then
      if ARGV[5] ~= 'runtime' then
        wake = wake .. ' ' .. ARGV[5]  -- that role's loop has nothing new to read: no need to wake it
      end
    end
  end
end
if skip_runtime then wake = wake .. ' runtime' end
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
      redis.call('XADD', KEYS[DIRECTORY[i]], '*', 's', ARGV[10], 't', meta[2] or ARGV[7])
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

# KEYS: a directory (or set-aside) stream.  ARGV: its group, ms, ms.  Reply: 1 when a consumer that
# holds entries has not touched the group for the first ms (an owner claims its handles every other
# renewal: one that stopped is dead or stalled, and its entries come due), else 0; 1 also when the
# group cannot be read (the caller's read of the pending entries says why).  A consumer that holds
# none and has not touched the group for the second ms is forgotten (``XGROUP DELCONSUMER``: it
# loses nothing, and a worker of that name that reads again is its consumer anew), so the list stays
# as long as the workers alive.  ``XINFO CONSUMERS`` costs a few µs a consumer; scanning the pending
# entries for idle ones (``XPENDING … IDLE``) costs one each, every session every worker of the
# role holds.
STALE_HOLDER = """
local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if consumers.err then return 1 end
local stale, after, forget = 0, tonumber(ARGV[2]), tonumber(ARGV[3])
for _, consumer in ipairs(consumers) do
  local seen = {}
  for i = 1, #consumer, 2 do seen[consumer[i]] = consumer[i + 1] end
  if seen['pending'] > 0 then
    if seen['idle'] >= after then stale = 1 end
  elseif seen['idle'] >= forget then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], seen['name'])
  end
end
return stale
"""

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


# KEYS: an API key's bucket, its tenant's bucket.  ARGV: the key's rate (tokens a second) and burst,
# the tenant's rate and burst (a rate of 0: that bucket is not drawn from).  Reply: {1, 0} a token
# taken from each | {0, ms until one would be, 1 the key's bucket | 2 the tenant's}.  Nothing is
# taken unless both have one, so a refused request costs neither.
TAKE_TOKENS = (
    _NOW
    + """
local state, wait, empty = {}, 0, 0
for i = 1, 2 do
  local rate, burst = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if rate > 0 then
    local got = redis.call('HMGET', KEYS[i], 'tokens', 'at')
    local tokens = tonumber(got[1] or burst)
    local at = tonumber(got[2] or now)
    if now > at then tokens = math.min(burst, tokens + (now - at) * rate / 1000) end
    if tokens < 1 then
      local ms = math.ceil((1 - tokens) * 1000 / rate)
      if ms > wait then wait, empty = ms, i end
    end
    state[i] = {tokens, math.max(now, at), rate, burst}
  end
end
if empty > 0 then return {0, wait, empty} end
for i, s in pairs(state) do
  redis.call('HSET', KEYS[i], 'tokens', tostring(s[1] - 1), 'at', s[2])
  redis.call('PEXPIRE', KEYS[i], math.ceil(s[4] * 1000 / s[3]) + 1000)
end
return {1, 0, 0}
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
# only what it spent since.  Reply: today's total.  With a third key (the tenant's calls in flight),
# the run's reservation there is settled (removed) too.
COUNT_TOKENS = """
if KEYS[3] then redis.call('HDEL', KEYS[3], ARGV[1]) end
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


# KEYS: the tenant's tokens hash of today, the tenant's calls in flight (hash: ``<session>:<run>`` ->
# ``<estimate> <expires ms>``).  ARGV: the run's field, its call's estimated tokens, the tenant's
# tokens a day, the reservation's time to live (ms).  A call may go when the day has tokens left
# and either no other call of the tenant is in flight or every call in flight, this one's estimate
# included, fits in what is left: so the day is overspent by at most one call of the tenant, not
# one per open run.  Expired reservations (a worker that died mid-call) are dropped.
# Reply: {1, total} reserved | {0, total} the day is spent | {2, total, in flight} wait for those.
RESERVE_TOKENS = (
    _NOW
    + """
local total = tonumber(redis.call('HGET', KEYS[1], '_total') or 0)
if total >= tonumber(ARGV[3]) then return {0, total} end
local flat = redis.call('HGETALL', KEYS[2])
local reserved, others = 0, 0
for i = 1, #flat, 2 do
  local estimate, expires = string.match(flat[i + 1], '(%d+) (%d+)')
  if tonumber(expires) < now then
    redis.call('HDEL', KEYS[2], flat[i])
  elseif flat[i] ~= ARGV[1] then
    reserved, others = reserved + tonumber(estimate), others + 1
  end
end
if others > 0 and total + reserved + tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  return {2, total, others}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. (now + tonumber(ARGV[4])))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]) * 2)
return {1, total}
"""
)


# --- the model's shared limits (``agent/throttle.py``) ---------------------------------------------

# KEYS: held (zset: ticket -> lease end ms), window (zset: ticket -> when granted, ms), turns (zset:
#       tenant -> its turn, lowest first), waiting (zset: ticket -> when its waiter is given up, ms),
#       owners (hash: waiting ticket -> tenant), counts (hash: tenant -> its live waiters), paused
#       (string: until when, ms), seq (string: the last turn handed out)
# ARGV: ticket, tenant, max in flight (0: no limit), calls a minute (0: no limit), lease ms, waiter ttl ms
# Reply: {1, 0, ''} the ticket holds a permit | {0, ms to wait, why}: 'paused', 'concurrency', 'rate', 'turn'.
# Fair among tenants: a permit free now goes to the tenants whose turn comes first (each tenant with a
# live waiter has one turn in the queue; served, it goes to the back), so a tenant with a hundred calls
# waiting and one with one alternate.  A waiter that stops asking is given up after its ttl, a holder
# that stops renewing after its lease: a dead worker's permits come back by themselves.
MODEL_PERMIT = (
    _NOW
    + """
local ticket, tenant = ARGV[1], ARGV[2]
local most, rpm, lease, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local KEEP = 600000
local function forget_waiter(t)
  if redis.call('ZREM', KEYS[4], t) == 1 then
    local who = redis.call('HGET', KEYS[5], t)
    redis.call('HDEL', KEYS[5], t)
    if who and redis.call('HINCRBY', KEYS[6], who, -1) <= 0 then
      redis.call('HDEL', KEYS[6], who)
      redis.call('ZREM', KEYS[3], who)
    end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for _, t in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 100)) do forget_waiter(t) end
if redis.call('ZSCORE', KEYS[1], ticket) then
  redis.call('ZADD', KEYS[1], now + lease, ticket)
  return {1, 0, ''}
end
-- (the caller waits in its tenant's turn from now on, until granted or given up)
if redis.call('ZADD', KEYS[4], now + ttl, ticket) == 1 then
  redis.call('HSET', KEYS[5], ticket, tenant)
  if redis.call('HINCRBY', KEYS[6], tenant, 1) == 1 then
    redis.call('ZADD', KEYS[3], 'NX', redis.call('INCR', KEYS[8]), tenant)
  end
end
for i = 3, 8 do redis.call('PEXPIRE', KEYS[i], KEEP) end
local paused = tonumber(redis.call('GET', KEYS[7]) or '0')
if paused > now then return {0, paused - now, 'paused'} end
local room = -1
if most > 0 then room = most - redis.call('ZCARD', KEYS[1]) end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 60000)
  local left = rpm - redis.call('ZCARD', KEYS[2])
  if left <= 0 then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return {0, math.max(1, tonumber(oldest[2]) + 60000 - now), 'rate'}
  end
  if room < 0 or left < room then room = left end
end
local rank = redis.call('ZRANK', KEYS[3], tenant) or 0
if room == 0 then return {0, math.min(1000, 50 * (rank + 1)), 'concurrency'} end
if room > 0 and rank >= room then return {0, math.min(1000, 50 * (rank - room + 1)), 'turn'} end
forget_waiter(ticket)
if redis.call('HGET', KEYS[6], tenant) then
  redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[8]), tenant)  -- to the back of the turns
end
redis.call('ZADD', KEYS[1], now + lease, ticket)
redis.call('PEXPIRE', KEYS[1], math.max(KEEP, lease))
if rpm > 0 then
  redis.call('ZADD', KEYS[2], now, ticket .. ':' .. now)
  redis.call('PEXPIRE', KEYS[2], 61000)
end
return {1, 0, ''}
"""
)

# KEYS: held, waiting, owners, counts, turns (as MODEL_PERMIT's).  ARGV: ticket.  The ticket gives its
# permit back, or stops waiting.
MODEL_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  local who = redis.call('HGET', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  if who and redis.call('HINCRBY', KEYS[4], who, -1) <= 0 then
    redis.call('HDEL', KEYS[4], who)
    redis.call('ZREM', KEYS[5], who)
  end
end
return 1
"""

# KEYS: held.  ARGV: ticket, lease ms.  Reply: 1 the permit is held for another lease | 0 it was lost.
MODEL_RENEW = (
    _NOW
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""
)

# KEYS: paused.  ARGV: ms.  No permit is granted for the next ARGV[1] ms (a server's Retry-After),
# unless a longer pause was asked for already.  Reply: until when (ms).
MODEL_PAUSE = (
    _NOW
    + """
local till = now + tonumber(ARGV[1])
local paused = tonumber(redis.call('GET', KEYS[1]) or '0')
if paused >= till then return paused end
redis.call('SET', KEYS[1], till, 'PX', tonumber(ARGV[1]) + 1000)
return till
"""
)


# --- tenants' secrets (``agent/secrets.py``) --------------------------------------------------------

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
