"""The PostgreSQL store's schema: versioned migrations, applied at start under an advisory lock.

`MIGRATIONS` is append-only: entry N (from 1) is applied once to a database, in one
transaction with its row in `schema_migrations`. `migrate` takes a transaction-scoped
advisory lock first (`pg_advisory_xact_lock`, keyed by the schema's name), so replicas that
start at once apply each migration exactly once: the second waits for the first and then
finds nothing left to do. `pending` lists what `gateway db migrate --dry-run` prints.

The store's steps that must be atomic and cheap (admission, booking, a turn's commit) are
functions of the schema (`gw_admit`, `gw_settle`, `gw_commit_turn`, ...): one round trip
each, in READ COMMITTED, with row locks taken in one order everywhere (docs/stores.md,
"PostgreSQL: locks"): a run's row, then the reservation being booked, then ledger rows by
(scope, period), then rate clocks by scope, then the day's spend row.

Money is integer micro-dollars (`bigint`), times are epoch seconds (`double precision`):
the database's clock (`clock_timestamp()`) decides every expiry, rate clock and lease, so
replicas on machines whose clocks differ still agree.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from gateway.store.audit import GENESIS


class Migration(NamedTuple):
    version: int
    name: str
    sql: str


_TABLES: Final = f"""
CREATE TABLE runs (
    id text PRIMARY KEY,
    team text NOT NULL,
    status text NOT NULL,
    policy text NOT NULL,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    revision bigint NOT NULL,
    turns integer NOT NULL DEFAULT 0,
    cost_micros bigint NOT NULL DEFAULT 0,
    prompt_tokens bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    ord bigserial NOT NULL,
    body bytea NOT NULL
);
CREATE INDEX runs_created ON runs (created_at DESC, ord DESC);
CREATE INDEX runs_team_created ON runs (team, created_at DESC, ord DESC);
CREATE INDEX runs_status_created ON runs (status, created_at DESC, ord DESC);
CREATE INDEX runs_finished ON runs (updated_at) WHERE status <> 'running';

-- A run's transcript beside its head (`runs.body`, run schema 5: base.RunWrite): each message
-- (kind 0, its JSON) and each turn's usage (kind 1, "prompt completion") one row, written once.
CREATE TABLE transcripts (
    run_id text NOT NULL,
    kind smallint NOT NULL,
    seq integer NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (run_id, kind, seq)
);

CREATE TABLE event_heads (run_id text PRIMARY KEY, last_seq bigint NOT NULL);
CREATE TABLE events (
    run_id text NOT NULL,
    seq bigint NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- A team's ledger of a period is LEDGER_SLOTS rows (slot 0..7), summed on read (slot -1: see gw_book); a hold's
-- (scope 'key:...', 'user:...') is one row, slot 0. `cap`: the slot's share of `budget` (the
-- team budget the shares were made for), see gw_admit.
CREATE TABLE ledger (
    scope text COLLATE "C" NOT NULL,
    period text COLLATE "C" NOT NULL,
    slot smallint NOT NULL DEFAULT 0,
    spent_micros bigint NOT NULL DEFAULT 0,
    cap bigint,
    budget bigint,
    PRIMARY KEY (scope, period, slot)
);

CREATE TABLE reservations (
    id text PRIMARY KEY,
    team text NOT NULL,
    period text NOT NULL,
    amount_micros bigint NOT NULL,
    slot smallint NOT NULL DEFAULT 0,
    expires_at double precision NOT NULL,
    run_id text,
    owner text NOT NULL DEFAULT '',
    scopes text[] NOT NULL DEFAULT '{{}}',
    budgets text[] NOT NULL DEFAULT '{{}}',
    key_id text NOT NULL DEFAULT '',
    "user" text NOT NULL DEFAULT '',
    model text NOT NULL DEFAULT '',
    policy text NOT NULL DEFAULT ''
);
CREATE INDEX reservations_team ON reservations (team, period, expires_at);
CREATE INDEX reservations_slot ON reservations (team, period, slot, expires_at);
CREATE INDEX reservations_run ON reservations (run_id, expires_at) WHERE run_id IS NOT NULL;
CREATE INDEX reservations_owner ON reservations (owner) WHERE owner <> '';
CREATE INDEX reservations_expires ON reservations (expires_at);

CREATE TABLE clocks (
    scope text COLLATE "C" PRIMARY KEY,
    requests_tat double precision NOT NULL DEFAULT 0,
    tokens_tat double precision NOT NULL DEFAULT 0
);

-- A run's lease and its fence (base.Lease): the row is the last lease taken on the run, `epoch` its
-- fencing token; a released lease keeps its row with expires_at 0, so a run's epochs only grow.
CREATE TABLE leases (run_id text PRIMARY KEY, owner text NOT NULL, expires_at double precision NOT NULL,
                     epoch bigint NOT NULL DEFAULT 1);
CREATE INDEX leases_owner ON leases (owner);

CREATE TABLE responses (id text PRIMARY KEY, team text NOT NULL, created_at double precision NOT NULL,
                        body bytea NOT NULL);
CREATE INDEX responses_created ON responses (created_at);

CREATE TABLE outbox (
    id text PRIMARY KEY,
    body bytea NOT NULL,
    period text,
    created_at double precision NOT NULL,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts integer NOT NULL DEFAULT 0,
    due_at double precision NOT NULL,
    owner text NOT NULL DEFAULT '',
    error text NOT NULL DEFAULT '',
    done_at double precision
);
CREATE INDEX outbox_due ON outbox (due_at) WHERE state = 'pending';
CREATE INDEX outbox_owner ON outbox (owner) WHERE state = 'pending' AND owner <> '';
CREATE INDEX outbox_done ON outbox (done_at) WHERE done_at IS NOT NULL;

CREATE TABLE keys (id text COLLATE "C" PRIMARY KEY, team text NOT NULL, revision bigint NOT NULL, body bytea NOT NULL,
                   last_used_at double precision);
CREATE INDEX keys_revision ON keys (revision);
CREATE INDEX keys_team ON keys (team, id);
CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO counters (name, value) VALUES ('keys', 0);

CREATE TABLE console_sessions (id_hash text PRIMARY KEY, key_id text NOT NULL,
                               idle_until double precision NOT NULL, expires_at double precision NOT NULL,
                               body bytea NOT NULL);
CREATE INDEX console_sessions_ends ON console_sessions (LEAST(idle_until, expires_at));

CREATE TABLE audit (seq bigint PRIMARY KEY, at double precision NOT NULL, action text NOT NULL,
                    team text NOT NULL, actor_team text NOT NULL, hash text NOT NULL, body bytea NOT NULL);
CREATE INDEX audit_at ON audit (at);
CREATE INDEX audit_action ON audit (action, seq);
CREATE TABLE audit_head (one boolean PRIMARY KEY DEFAULT true CHECK (one), seq bigint NOT NULL, hash text NOT NULL);
INSERT INTO audit_head (one, seq, hash) VALUES (true, 0, '{GENESIS}');

CREATE TABLE spend_rows (
    day date NOT NULL,
    team text COLLATE "C" NOT NULL,
    key_id text COLLATE "C" NOT NULL,
    "user" text COLLATE "C" NOT NULL,
    model text COLLATE "C" NOT NULL,
    policy text COLLATE "C" NOT NULL,
    run_id text COLLATE "C" NOT NULL,
    cost_micros bigint NOT NULL,
    calls bigint NOT NULL,
    prompt_tokens bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (day, team, key_id, "user", model, policy, run_id)
);
CREATE INDEX spend_rows_team_day ON spend_rows (team, day);

CREATE VIEW spend AS
SELECT day, team, key_id AS key, "user", model, policy, NULLIF(run_id, '') AS run,
       prompt_tokens, completion_tokens, prompt_tokens + completion_tokens AS tokens, calls,
       cost_micros, cost_micros / 1000000.0 AS cost_usd
FROM spend_rows;
COMMENT ON VIEW spend IS 'Spend per UTC day, team, key, user, model, policy and run (docs/stores.md)';
"""

_BOOK: Final = """
-- A booking of `p_actual` micros on a team's period ledger (its slot `p_slot`) and then on the
-- ledgers of its holds (`p_budgets`: 'scope#period' each) in (scope, period) order, and on the
-- day's spend row of its attribution and run (with the turn's tokens when known).
CREATE FUNCTION gw_book(p_team text, p_period text, p_slot smallint, p_actual bigint, p_budgets text[], p_key text,
                        p_user text, p_model text, p_policy text, p_run text, p_prompt bigint, p_completion bigint,
                        p_now double precision) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_spent bigint;
    v_cap bigint;
BEGIN
    INSERT INTO ledger AS l (scope, period, slot, spent_micros) VALUES (p_team, p_period, p_slot, p_actual)
    ON CONFLICT (scope, period, slot) DO UPDATE SET spent_micros = l.spent_micros + excluded.spent_micros
    RETURNING l.spent_micros, l.cap INTO v_spent, v_cap;
    IF v_cap IS NOT NULL AND v_spent + (SELECT COALESCE(sum(amount_micros), 0) FROM reservations
            WHERE team = p_team AND period = p_period AND slot = p_slot AND expires_at > p_now) > v_cap THEN
        -- Spent past the slot's share (a call that cost more than it held): the shares no longer
        -- add up to the budget, so no admission may trust its own until they are made again.
        INSERT INTO ledger AS l (scope, period, slot, cap) VALUES (p_team, p_period, -1, 1)
        ON CONFLICT (scope, period, slot) DO UPDATE SET cap = 1;
    END IF;
    IF cardinality(p_budgets) > 0 THEN
        INSERT INTO ledger AS l (scope, period, spent_micros)
        SELECT s, p, p_actual FROM (
            SELECT regexp_replace(b, '#[^#]*$', '') AS s, substring(b FROM '#([^#]*)$') AS p FROM unnest(p_budgets) AS b
        ) AS todo ORDER BY s COLLATE "C", p COLLATE "C"
        ON CONFLICT (scope, period, slot) DO UPDATE SET spent_micros = l.spent_micros + excluded.spent_micros;
    END IF;
    INSERT INTO spend_rows AS r (day, team, key_id, "user", model, policy, run_id, cost_micros, calls,
                                 prompt_tokens, completion_tokens)
    VALUES ((to_timestamp(p_now) AT TIME ZONE 'UTC')::date, p_team, p_key, p_user, p_model, p_policy,
            COALESCE(p_run, ''), p_actual, 1, GREATEST(p_prompt, 0), GREATEST(p_completion, 0))
    ON CONFLICT (day, team, key_id, "user", model, policy, run_id) DO UPDATE
    SET cost_micros = r.cost_micros + excluded.cost_micros, calls = r.calls + 1,
        prompt_tokens = r.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = r.completion_tokens + excluded.completion_tokens;
END $$;

-- Token clocks pushed by what a call used beyond what its admission counted: scope i by
-- p_tokens[i] * p_per[i] seconds, from no earlier than now, in scope order.
CREATE FUNCTION gw_charge_tokens(p_scopes text[], p_tokens bigint[], p_per double precision[],
                                 p_now double precision) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_scopes IS NULL OR cardinality(p_scopes) = 0 THEN RETURN; END IF;
    UPDATE clocks AS c SET tokens_tat = GREATEST(c.tokens_tat, p_now) + t.n * t.per
    FROM (SELECT s, n, per FROM unnest(p_scopes, p_tokens, p_per) AS u(s, n, per) ORDER BY s COLLATE "C") AS t
    WHERE c.scope = t.s;
END $$;

-- Settles a reservation once: deletes it and books `p_actual` on its ledgers, its spend row,
-- and its token clocks. False (nothing booked) when it was settled or released already.
CREATE FUNCTION gw_settle(p_id text, p_actual bigint, p_scopes text[], p_tokens bigint[],
                          p_per double precision[], p_now double precision, p_prompt bigint DEFAULT 0,
                          p_completion bigint DEFAULT 0) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    DELETE FROM reservations WHERE id = p_id
    RETURNING team, period, slot, budgets, key_id, "user", model, policy, run_id INTO r;
    IF NOT FOUND THEN RETURN false; END IF;
    PERFORM gw_book(r.team, r.period, r.slot, p_actual, r.budgets, r.key_id, r."user", r.model, r.policy, r.run_id,
                    p_prompt, p_completion, p_now);
    PERFORM gw_charge_tokens(p_scopes, p_tokens, p_per, p_now);
    RETURN true;
END $$;
"""

_EVENTS: Final = """
-- Whether a write under the lease (p_owner, p_epoch) may go on (base.Lease): the lease is still
-- the run's last taken and not released. Its row is locked FOR SHARE until the caller's
-- transaction ends, so a takeover (acquire_lease's UPDATE) waits for the write, or the write
-- sees the takeover: never both. No lease given (p_owner NULL): not fenced.
CREATE FUNCTION gw_fenced(p_run text, p_owner text, p_epoch bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF p_owner IS NULL THEN RETURN true; END IF;
    PERFORM 1 FROM leases WHERE run_id = p_run AND owner = p_owner AND epoch = p_epoch AND expires_at > 0 FOR SHARE;
    RETURN FOUND;
END $$;

-- A save's transcript rows (base.RunWrite): what lies past the positions first, when the
-- history was rewritten (p_trunc), then the new messages from m_from, the new turns from u_from.
CREATE FUNCTION gw_transcript(p_run text, p_trunc boolean, m_from integer, m_items bytea[], u_from integer,
                              u_items bytea[]) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_trunc THEN
        DELETE FROM transcripts WHERE run_id = p_run AND (kind = 0 AND seq >= m_from OR kind = 1 AND seq >= u_from);
    END IF;
    IF cardinality(m_items) > 0 OR cardinality(u_items) > 0 THEN
        INSERT INTO transcripts (run_id, kind, seq, body)
        SELECT p_run, 0, m_from + i - 1, b FROM unnest(m_items) WITH ORDINALITY AS u(b, i)
        UNION ALL SELECT p_run, 1, u_from + i - 1, b FROM unnest(u_items) WITH ORDINALITY AS u(b, i);
    END IF;
END $$;

-- A run's trace lines, numbered after the last (its head row, locked: appends of one run
-- take turns), and the outbox notices they cause; NOTIFY `p_signal` (a channel) when set.
-- With a lease (p_owner, p_epoch) no longer the run's: -1, nothing written (gw_fenced).
CREATE FUNCTION gw_append(p_run text, p_events bytea[], n_ids text[], n_bodies bytea[], n_periods text[],
                          p_signal text, p_now double precision, p_owner text DEFAULT NULL,
                          p_epoch bigint DEFAULT NULL) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    last bigint;
    added integer := 0;
BEGIN
    IF NOT gw_fenced(p_run, p_owner, p_epoch) THEN RETURN -1; END IF;
    IF cardinality(p_events) > 0 THEN
        INSERT INTO event_heads AS h (run_id, last_seq) VALUES (p_run, cardinality(p_events))
        ON CONFLICT (run_id) DO UPDATE SET last_seq = h.last_seq + cardinality(p_events)
        RETURNING h.last_seq INTO last;
        INSERT INTO events (run_id, seq, body)
        SELECT p_run, last - cardinality(p_events) + i, e FROM unnest(p_events) WITH ORDINALITY AS u(e, i);
    END IF;
    IF n_ids IS NOT NULL AND cardinality(n_ids) > 0 THEN
        INSERT INTO outbox (id, body, period, created_at, due_at)
        SELECT i, b, p, p_now, p_now FROM unnest(n_ids, n_bodies, n_periods) AS u(i, b, p)
        ON CONFLICT (id) DO NOTHING;
        GET DIAGNOSTICS added = ROW_COUNT;
        IF added > 0 THEN PERFORM pg_notify(current_schema() || '_outbox', ''); END IF;
    END IF;
    IF p_signal IS NOT NULL THEN PERFORM pg_notify(current_schema() || '_' || p_signal, p_run); END IF;
    RETURN added;
END $$;
"""

_ADMIT: Final = """
-- A Claim (gateway.store.base.Claim) checked and held in one step. Locks, in this order: the
-- run's row (when the claim checks its turn cap, calls in flight or budget), the team's ledger
-- rows of the period (with a team budget: one slot row, or all of them by slot), the holds'
-- ledger rows by (scope, period), then the clocks of its rate scopes by scope. Every step
-- that takes more than one of these takes them in this order, so none waits in a circle.
--
-- The team's budget is split over LEDGER_SLOTS slot rows, each with a share (`cap`) of it,
-- the shares summing to the budget. A claim first tries one slot (a random one, in a
-- subtransaction): its spending plus what its live reservations hold plus the claim within
-- its share, it holds there, locking that row alone, so concurrent admissions of one team
-- wait on each other only 1 in 8 times and their commits share WAL flushes. Else (the share
-- is used up, or the budget changed) the subtransaction is rolled back, which lets go of the
-- row, and the claim locks every slot row (in slot order), checks the team's whole figures,
-- exactly as one row would, and shares out what is left of the budget again. No slot holds
-- more than its share, so the team never holds more than its budget. A booking that spends
-- past its slot's share (a call dearer than what it held) marks the team's period (its row
-- of slot -1): until the shares are made again, every claim takes the path of every slot.
-- o_code: 1 granted, 0 refused (o_refusal, and the figures as checked), 2 `c_body` names a
-- run that is stored (o_body: the stored run; nothing written).
CREATE FUNCTION gw_admit(
    p_id text, p_team text, p_period text, p_amount bigint, p_ttl double precision, p_run text,
    p_max_turns integer, p_max_in_flight integer, p_run_budget bigint, p_budget bigint, p_owner text,
    p_tokens bigint,
    r_scope text[], r_window double precision[], r_rs double precision[], r_ts double precision[],
    r_mif integer[],
    h_kind text[], h_scope text[], h_period text[], h_budget bigint[],
    a_key text, a_user text, a_model text, a_policy text,
    c_body bytea, c_team text, c_status text, c_policy text, c_created double precision,
    c_updated double precision, c_revision bigint, c_turns integer, c_cost bigint, c_prompt bigint,
    c_completion bigint, p_slots integer, c_messages bytea[], c_items bytea[],
    OUT o_code integer, OUT o_refusal text, OUT o_body bytea, OUT o_now double precision,
    OUT o_revision bigint, OUT o_spent bigint, OUT o_reserved bigint, OUT o_turns integer,
    OUT o_in_flight integer, OUT o_cost bigint, OUT o_held bigint, OUT o_hold_spent bigint[],
    OUT o_hold_reserved bigint[], OUT o_rate_r double precision[], OUT o_rate_t double precision[],
    OUT o_rate_in_flight integer[])
LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := extract(epoch FROM clock_timestamp());
    n_rates integer := COALESCE(cardinality(r_scope), 0);
    n_holds integer := COALESCE(cardinality(h_scope), 0);
    n_slots constant integer := GREATEST(p_slots, 1);  -- postgres.LEDGER_SLOTS
    v_slot smallint := floor(random() * GREATEST(p_slots, 1))::smallint;
    v_fast boolean := false;
    v_own text := 'team:' || p_team;
    run_found boolean := false;
    v_budgets text[] := '{}';
    v_counted text[] := '{}';
    v_locked integer;
    v_s bigint;
    v_v bigint;
    v_cap bigint;
    v_used bigint[];
    v_rest bigint;
    i integer;
    v_rt double precision;
    v_tt double precision;
    v_nr integer;
BEGIN
    o_code := 1;
    o_now := now_s;
    IF c_body IS NOT NULL THEN
        INSERT INTO runs (id, team, status, policy, created_at, updated_at, revision, turns, cost_micros,
                          prompt_tokens, completion_tokens, body)
        VALUES (p_run, c_team, c_status, c_policy, c_created, c_updated, c_revision, c_turns, c_cost, c_prompt,
                c_completion, c_body)
        ON CONFLICT (id) DO NOTHING;
        IF NOT FOUND THEN
            o_code := 2;
            SELECT r.body INTO o_body FROM runs r WHERE r.id = p_run;
            RETURN;
        END IF;
        PERFORM gw_transcript(p_run, false, 0, c_messages, 0, c_items);
    END IF;
    -- 1. The run's row: its turn slots are counted under it.
    IF p_run IS NOT NULL THEN
        IF p_max_turns IS NOT NULL OR p_max_in_flight IS NOT NULL OR p_run_budget IS NOT NULL THEN
            SELECT r.turns, r.cost_micros, r.revision INTO o_turns, o_cost, o_revision
            FROM runs r WHERE r.id = p_run FOR NO KEY UPDATE;
        ELSE
            SELECT r.turns, r.cost_micros, r.revision INTO o_turns, o_cost, o_revision FROM runs r WHERE r.id = p_run;
        END IF;
        run_found := FOUND;
        SELECT count(*), COALESCE(sum(amount_micros), 0) INTO o_in_flight, o_held
        FROM reservations WHERE run_id = p_run AND expires_at > now_s;
    END IF;
    o_turns := COALESCE(o_turns, 0);
    o_cost := COALESCE(o_cost, 0);
    o_in_flight := COALESCE(o_in_flight, 0);
    o_held := COALESCE(o_held, 0);
    -- 2. The team's ledger: one slot within its share, or every slot.
    IF p_budget IS NOT NULL THEN
        BEGIN
            SELECT l.spent_micros, l.cap INTO v_s, v_cap FROM ledger l
            WHERE l.scope = p_team AND l.period = p_period AND l.slot = v_slot AND l.budget = p_budget
            FOR NO KEY UPDATE;
            IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = 'GW001'; END IF;
            SELECT COALESCE(sum(amount_micros), 0) INTO v_v FROM reservations
            WHERE team = p_team AND period = p_period AND slot = v_slot AND expires_at > now_s;
            IF v_s + v_v + p_amount > v_cap THEN RAISE EXCEPTION USING ERRCODE = 'GW001'; END IF;
            IF EXISTS (SELECT 1 FROM ledger WHERE scope = p_team AND period = p_period AND slot = -1 AND cap = 1) THEN
                RAISE EXCEPTION USING ERRCODE = 'GW001';  -- a booking overdrew its share: every slot, again
            END IF;
            v_fast := true;
        EXCEPTION WHEN SQLSTATE 'GW001' THEN
            v_fast := false;  -- the subtransaction's lock of the slot row is let go
        END;
        IF NOT v_fast THEN
            PERFORM 1 FROM ledger WHERE scope = p_team AND period = p_period AND slot BETWEEN 0 AND n_slots - 1
            ORDER BY slot FOR NO KEY UPDATE;
            GET DIAGNOSTICS v_locked = ROW_COUNT;
            IF v_locked < n_slots THEN
                INSERT INTO ledger (scope, period, slot) SELECT p_team, p_period, g FROM generate_series(0, n_slots - 1) g
                ON CONFLICT DO NOTHING;
                PERFORM 1 FROM ledger WHERE scope = p_team AND period = p_period AND slot BETWEEN 0 AND n_slots - 1
                ORDER BY slot FOR NO KEY UPDATE;
            END IF;
            SELECT COALESCE(sum(spent_micros), 0) INTO o_spent FROM ledger WHERE scope = p_team AND period = p_period;
            SELECT COALESCE(sum(amount_micros), 0) INTO o_reserved FROM reservations
            WHERE team = p_team AND period = p_period AND expires_at > now_s;
        END IF;
    END IF;
    -- 3. The holds' ledger rows.
    FOR i IN 1 .. n_holds LOOP
        v_budgets := v_budgets || (h_scope[i] || '#' || h_period[i]);
    END LOOP;
    IF n_holds > 0 THEN
        PERFORM 1 FROM ledger l JOIN unnest(h_scope, h_period) AS u(us, up)
            ON l.scope = u.us AND l.period = u.up AND l.slot = 0
        ORDER BY l.scope, l.period FOR NO KEY UPDATE OF l;
        GET DIAGNOSTICS v_locked = ROW_COUNT;
        IF v_locked < (SELECT count(DISTINCT (us, up)) FROM unnest(h_scope, h_period) AS u(us, up)) THEN
            INSERT INTO ledger (scope, period)
            SELECT DISTINCT us COLLATE "C", up COLLATE "C" FROM unnest(h_scope, h_period) AS u(us, up) ORDER BY 1, 2
            ON CONFLICT DO NOTHING;
            PERFORM 1 FROM ledger l JOIN unnest(h_scope, h_period) AS u(us, up)
                ON l.scope = u.us AND l.period = u.up AND l.slot = 0
            ORDER BY l.scope, l.period FOR NO KEY UPDATE OF l;
        END IF;
    END IF;
    -- 4. The rate scopes' clocks.
    IF n_rates > 0 THEN
        PERFORM 1 FROM clocks c WHERE c.scope = ANY(r_scope) ORDER BY c.scope FOR NO KEY UPDATE;
        GET DIAGNOSTICS v_locked = ROW_COUNT;
        IF v_locked < (SELECT count(DISTINCT x) FROM unnest(r_scope) AS x) THEN
            INSERT INTO clocks (scope) SELECT DISTINCT x COLLATE "C" FROM unnest(r_scope) AS x ORDER BY 1
            ON CONFLICT DO NOTHING;
            PERFORM 1 FROM clocks c WHERE c.scope = ANY(r_scope) ORDER BY c.scope FOR NO KEY UPDATE;
        END IF;
    END IF;
    -- The checks, in the order of base.Refusal.
    IF p_run IS NOT NULL AND NOT run_found THEN
        o_refusal := 'run_missing';
    ELSIF p_max_turns IS NOT NULL AND o_turns + o_in_flight >= p_max_turns THEN
        o_refusal := 'max_turns';
    ELSIF p_max_in_flight IS NOT NULL AND o_in_flight >= p_max_in_flight THEN
        o_refusal := 'busy';
    ELSIF p_run_budget IS NOT NULL AND o_cost + o_held + p_amount > p_run_budget THEN
        o_refusal := 'run_budget';
    END IF;
    o_hold_spent := '{}';
    o_hold_reserved := '{}';
    FOR i IN 1 .. n_holds LOOP
        SELECT COALESCE(sum(spent_micros), 0) INTO v_s FROM ledger WHERE scope = h_scope[i] AND period = h_period[i];
        SELECT COALESCE(sum(amount_micros), 0) INTO v_v FROM reservations
        WHERE team = p_team AND expires_at > now_s AND budgets @> ARRAY[h_scope[i] || '#' || h_period[i]];
        o_hold_spent := o_hold_spent || v_s;
        o_hold_reserved := o_hold_reserved || v_v;
        IF o_refusal IS NULL AND v_s + v_v + p_amount > h_budget[i] THEN
            o_refusal := h_kind[i] || '_budget';
        END IF;
    END LOOP;
    IF o_refusal IS NULL AND p_budget IS NOT NULL AND NOT v_fast AND o_spent + o_reserved + p_amount > p_budget THEN
        o_refusal := 'team_budget';
    END IF;
    o_rate_r := '{}';
    o_rate_t := '{}';
    o_rate_in_flight := '{}';
    FOR i IN 1 .. n_rates LOOP
        SELECT c.requests_tat, c.tokens_tat INTO v_rt, v_tt FROM clocks c WHERE c.scope = r_scope[i];
        v_nr := 0;
        IF r_mif[i] IS NOT NULL THEN
            IF r_scope[i] = v_own THEN
                SELECT count(*) INTO v_nr FROM reservations WHERE team = p_team AND expires_at > now_s;
            ELSE
                SELECT count(*) INTO v_nr FROM reservations
                WHERE team = p_team AND expires_at > now_s AND scopes @> ARRAY[r_scope[i]];
                v_counted := v_counted || r_scope[i];
            END IF;
        END IF;
        IF o_refusal IS NULL AND ((r_mif[i] IS NOT NULL AND v_nr >= r_mif[i])
                OR (r_rs[i] IS NOT NULL AND GREATEST(v_rt, now_s) + r_rs[i] - now_s > r_window[i] + 0.000001)
                OR (r_ts[i] IS NOT NULL AND GREATEST(v_tt, now_s) + p_tokens * r_ts[i] - now_s
                    > r_window[i] + 0.000001)) THEN
            o_refusal := 'rate_limit';
        END IF;
        o_rate_r := o_rate_r || v_rt;
        o_rate_t := o_rate_t || v_tt;
        o_rate_in_flight := o_rate_in_flight || v_nr;
    END LOOP;
    IF o_refusal IS NOT NULL THEN
        o_code := 0;
        IF o_spent IS NULL THEN  -- the team's figures, for the refusal's answer
            SELECT COALESCE(sum(spent_micros), 0) INTO o_spent FROM ledger WHERE scope = p_team AND period = p_period;
            SELECT COALESCE(sum(amount_micros), 0) INTO o_reserved FROM reservations
            WHERE team = p_team AND period = p_period AND expires_at > now_s;
        END IF;
        RETURN;
    END IF;
    -- Granted: hold it, and spend the clocks.
    INSERT INTO reservations (id, team, period, amount_micros, slot, expires_at, run_id, owner, scopes, budgets,
                              key_id, "user", model, policy)
    VALUES (p_id, p_team, p_period, p_amount, v_slot, now_s + p_ttl, p_run, p_owner, v_counted, v_budgets, a_key,
            a_user, a_model, a_policy);
    IF p_budget IS NOT NULL AND NOT v_fast THEN
        -- Every slot row is locked: share what is left of the budget out again, each slot's
        -- share its spending and holds (the claim's included) plus an eighth of the rest.
        SELECT array_agg(COALESCE(l.spent_micros, 0) + COALESCE(r.held, 0) ORDER BY g) INTO v_used
        FROM generate_series(0, n_slots - 1) AS g
        LEFT JOIN ledger l ON l.scope = p_team AND l.period = p_period AND l.slot = g
        LEFT JOIN (SELECT slot, sum(amount_micros) AS held FROM reservations
                   WHERE team = p_team AND period = p_period AND expires_at > now_s GROUP BY slot) r ON r.slot = g;
        v_rest := GREATEST(p_budget - o_spent - o_reserved - p_amount, 0);  -- every row's spending counted
        UPDATE ledger SET budget = p_budget,
            cap = v_used[slot + 1] + v_rest / n_slots + CASE WHEN slot = 0 THEN v_rest % n_slots ELSE 0 END
        WHERE scope = p_team AND period = p_period AND slot BETWEEN 0 AND n_slots - 1;
        UPDATE ledger SET cap = 0 WHERE scope = p_team AND period = p_period AND slot = -1 AND cap = 1;
    END IF;
    FOR i IN 1 .. n_rates LOOP
        IF r_rs[i] IS NOT NULL OR r_ts[i] IS NOT NULL THEN
            v_rt := o_rate_r[i];
            v_tt := o_rate_t[i];
            IF r_rs[i] IS NOT NULL THEN v_rt := GREATEST(v_rt, now_s) + r_rs[i]; END IF;
            IF r_ts[i] IS NOT NULL THEN v_tt := GREATEST(v_tt, now_s) + p_tokens * r_ts[i]; END IF;
            UPDATE clocks SET requests_tat = v_rt, tokens_tat = v_tt WHERE scope = r_scope[i];
            o_rate_r[i] := v_rt;
            o_rate_t[i] := v_tt;
        END IF;
    END LOOP;
END $$;
"""

_COMMIT: Final = """
-- A turn: the run's save (only if its revision is `p_expected`, and, with a lease, only while
-- the lease is the run's: gw_fenced), its head and new transcript rows, its trace lines and
-- notices, and its booking (a reservation settled, or `b_actual` charged to the team's period),
-- as one step. Locks the run's lease row (with a lease), then the run's row, then (settle) the
-- reservation's, the ledgers, the clocks.
-- o_code: 1 saved, 0 no such run, 2 stale (o_stored: the stored revision), 3 `b_if_held` and
-- the reservation was booked or released already, 4 the lease is no longer the run's;
-- nothing is written unless 1.
CREATE FUNCTION gw_commit_turn(
    p_id text, p_expected bigint, p_revision bigint, p_team text, p_status text, p_policy text,
    p_updated double precision, p_turns integer, p_cost bigint, p_prompt bigint, p_completion bigint, p_body bytea,
    p_events bytea[], n_ids text[], n_bodies bytea[], n_periods text[], p_signal text,
    b_book boolean, b_rid text, b_if_held boolean, b_actual bigint, b_team text, b_period text,
    t_scopes text[], t_tokens bigint[], t_per double precision[],
    l_owner text, l_epoch bigint, w_trunc boolean, w_from integer, w_messages bytea[], w_turns_from integer,
    w_turns bytea[], b_key text, b_user text, b_model text, b_policy text,
    OUT o_code integer, OUT o_stored bigint, OUT o_spent bigint, OUT o_reserved bigint)
LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := extract(epoch FROM clock_timestamp());
    cur record;
BEGIN
    IF NOT gw_fenced(p_id, l_owner, l_epoch) THEN o_code := 4; RETURN; END IF;
    SELECT r.revision, r.prompt_tokens, r.completion_tokens INTO cur FROM runs r WHERE r.id = p_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN o_code := 0; RETURN; END IF;
    IF cur.revision <> p_expected THEN o_code := 2; o_stored := cur.revision; RETURN; END IF;
    IF b_book AND b_if_held AND b_rid IS NOT NULL THEN
        PERFORM 1 FROM reservations WHERE id = b_rid FOR UPDATE;
        IF NOT FOUND THEN o_code := 3; RETURN; END IF;
    END IF;
    UPDATE runs SET team = p_team, status = p_status, policy = p_policy, updated_at = p_updated,
                    revision = p_revision, turns = p_turns, cost_micros = p_cost, prompt_tokens = p_prompt,
                    completion_tokens = p_completion, body = p_body
    WHERE id = p_id;
    PERFORM gw_transcript(p_id, w_trunc, w_from, w_messages, w_turns_from, w_turns);
    PERFORM gw_append(p_id, p_events, n_ids, n_bodies, n_periods, p_signal, now_s);
    o_code := 1;
    IF NOT b_book THEN RETURN; END IF;
    IF b_rid IS NOT NULL THEN
        PERFORM gw_settle(b_rid, b_actual, t_scopes, t_tokens, t_per, now_s, p_prompt - cur.prompt_tokens,
                          p_completion - cur.completion_tokens);
    ELSIF b_actual <> 0 THEN
        PERFORM gw_book(b_team, b_period, 0::smallint, b_actual, '{}', b_key, b_user, b_model, b_policy, NULL, 0, 0,
                        now_s);
    END IF;
    SELECT COALESCE(sum(spent_micros), 0) INTO o_spent FROM ledger WHERE scope = b_team AND period = b_period;
    SELECT COALESCE(sum(amount_micros), 0) INTO o_reserved FROM reservations
    WHERE team = b_team AND period = b_period AND expires_at > now_s;
END $$;
"""

_RELOADS: Final = """
-- The last reload announced to every replica of the schema (base.ReloadMark): announcing one
-- bumps `generation` and NOTIFYs `<schema>_reload` in the same transaction; replicas listen
-- and poll it to reload their own files too (gateway.server.reload_watch).
CREATE TABLE reloads (id smallint PRIMARY KEY CHECK (id = 1), generation bigint NOT NULL, origin text NOT NULL);
INSERT INTO reloads (id, generation, origin) VALUES (1, 0, '');
"""

MIGRATIONS: Final[tuple[Migration, ...]] = (
    # Append only: a database records the versions applied in schema_migrations.
    Migration(1, "tables, indexes and the spend view", _TABLES),
    Migration(2, "booking, trace and admission functions", _BOOK + _EVENTS + _ADMIT + _COMMIT),
    Migration(3, "the reload mark", _RELOADS),
)

LOCK_NAMESPACE: Final = 0x67770033
"""The advisory lock's first key (`pg_advisory_xact_lock(int, int)`); the second is the
schema's name hashed (`hashtext`), so gateways on other schemas of one database don't wait."""


def bootstrap(schema: str) -> str:
    """What runs before the migrations: the schema and its migrations table."""
    return (f"CREATE SCHEMA IF NOT EXISTS {quote(schema)};\n"
            f"CREATE TABLE IF NOT EXISTS {quote(schema)}.schema_migrations (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());")


def quote(name: str) -> str:
    """A schema name as an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def script(pending: tuple[Migration, ...], schema: str) -> str:
    """The SQL `gateway db migrate --dry-run` prints: what `migrate` would run, in order."""
    parts = [f"-- schema {schema}", bootstrap(schema), f"SET search_path TO {quote(schema)};"]
    for m in pending:
        parts.append(f"-- migration {m.version}: {m.name}\nBEGIN;\n{m.sql.strip()}\n"
                     f"INSERT INTO schema_migrations (version, name) VALUES ({m.version}, '{m.name}');\nCOMMIT;")
    return "\n\n".join(parts) + "\n"
