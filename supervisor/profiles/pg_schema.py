"""The shared store's schema: versioned migrations and the version check of read-only commands.

`sfguard start --store postgresql://...` migrates the database (supervisor/profiles/pg_backend.py
calls `migrate` when it opens); read-only commands only check the version (`check_schema`).
"""
from __future__ import annotations

import logging
import time

from sfguard.supervisor.profiles import audit as audit_mod
from sfguard.supervisor.protocols import ProfileError

log = logging.getLogger("sfguard.pg_store")     # one logger for the whole shared store

__all__ = ["MIGRATIONS", "NoSchema", "SchemaTooNew", "SchemaTooOld", "check_schema", "migrate"]


class SchemaTooNew(ProfileError):
    """The database schema is newer than this sfguard knows: refuse to start."""


class SchemaTooOld(ProfileError):
    """A read-only command on a database an older sfguard migrated: `sfguard start` of this
    version migrates it; read-only commands never do."""


class NoSchema(ProfileError):
    """A read-only command on a database no guard has started on yet (no sfguard tables)."""


#: Versioned migrations, applied in order at start inside one transaction under an advisory
#: lock (so two guards starting at once apply them once). Never edit a released step: add one.
MIGRATIONS: list[str] = [
    # 1: profiles, blobs, guards, leases, queue, audit, scope keys
    f"""
    CREATE TABLE sfguard_meta (
        id int PRIMARY KEY CHECK (id = 1),
        key_check text NOT NULL
    );
    CREATE TABLE sfguard_scope_keys (
        scope text PRIMARY KEY,
        wrapped bytea NOT NULL
    );
    CREATE SEQUENCE sfguard_blob_ids;
    CREATE TABLE sfguard_profiles (
        scope text NOT NULL,
        name text NOT NULL,
        identity text,
        created double precision NOT NULL,
        updated double precision NOT NULL,
        last_used double precision,
        last_login_check double precision,
        last_login_ok boolean,
        size bigint NOT NULL,
        blob_id bigint NOT NULL,
        written_generation bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, name)
    );
    CREATE TABLE sfguard_blob_chunks (
        blob_id bigint NOT NULL,
        idx int NOT NULL,
        data bytea NOT NULL,
        PRIMARY KEY (blob_id, idx)
    );
    CREATE TABLE sfguard_guards (
        guard_id text PRIMARY KEY,
        host text NOT NULL,
        pid int NOT NULL,
        started double precision NOT NULL,
        ttl double precision NOT NULL,
        expires_at timestamptz NOT NULL
    );
    CREATE TABLE sfguard_leases (
        scope text NOT NULL,
        name text NOT NULL,
        holder_run text,
        holder_guard text,
        holder_since double precision,
        generation bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, name)
    );
    CREATE TABLE sfguard_queue (
        scope text NOT NULL,
        name text NOT NULL,
        run text NOT NULL,
        guard_id text NOT NULL,
        since double precision NOT NULL,
        seq bigserial,
        PRIMARY KEY (scope, name, run, guard_id)
    );
    CREATE INDEX sfguard_queue_order ON sfguard_queue (scope, name, seq);
    CREATE TABLE sfguard_audit (
        seq bigint PRIMARY KEY,
        body text NOT NULL
    );
    CREATE TABLE sfguard_audit_head (
        id int PRIMARY KEY CHECK (id = 1),
        seq bigint NOT NULL,
        hash text NOT NULL,
        mac text
    );
    INSERT INTO sfguard_audit_head (id, seq, hash, mac) VALUES (1, 0, '{audit_mod.GENESIS}', NULL);
    """,
    # 2: key versions (supervisor/profiles/pg_keys.py): which exist (check values), which is
    # current and the rotation under way; scope keys, profiles and the audit head per version.
    # What was there is version 1.
    """
    CREATE TABLE sfguard_key_versions (
        version int PRIMARY KEY,
        key_check text NOT NULL,
        created double precision NOT NULL,
        retired double precision
    );
    INSERT INTO sfguard_key_versions (version, key_check, created)
        SELECT 1, key_check, extract(epoch FROM now()) FROM sfguard_meta;
    ALTER TABLE sfguard_meta ADD COLUMN current_version int NOT NULL DEFAULT 1,
        ADD COLUMN rotation_from int, ADD COLUMN rotation_to int,
        ADD COLUMN rotation_started double precision,
        ADD COLUMN rotation_switched boolean NOT NULL DEFAULT false;
    ALTER TABLE sfguard_scope_keys ADD COLUMN version int NOT NULL DEFAULT 1;
    ALTER TABLE sfguard_scope_keys DROP CONSTRAINT sfguard_scope_keys_pkey;
    ALTER TABLE sfguard_scope_keys ADD PRIMARY KEY (scope, version);
    ALTER TABLE sfguard_profiles ADD COLUMN key_version int NOT NULL DEFAULT 1;
    ALTER TABLE sfguard_audit_head ADD COLUMN kid int NOT NULL DEFAULT 1;
    """,
    # 3: run records (supervisor/record/shared.py): each guard host's records, their index for
    # listing and searching on any host, and, once a run ended, its timeline and screenshots
    """
    CREATE TABLE sfguard_run_records (
        host text NOT NULL,
        record text NOT NULL,
        run_id text NOT NULL,
        started double precision NOT NULL,
        ended double precision,
        state text NOT NULL,
        outcome text,
        pipeline text,
        profiles text[] NOT NULL DEFAULT '{}',
        index_json text NOT NULL,
        PRIMARY KEY (host, record)
    );
    CREATE INDEX sfguard_run_records_started ON sfguard_run_records (started);
    CREATE INDEX sfguard_run_records_run ON sfguard_run_records (run_id);
    CREATE TABLE sfguard_run_record_lines (
        host text NOT NULL,
        record text NOT NULL,
        body bytea NOT NULL,
        PRIMARY KEY (host, record)
    );
    CREATE TABLE sfguard_run_record_shots (
        host text NOT NULL,
        record text NOT NULL,
        name text NOT NULL,
        data bytea NOT NULL,
        PRIMARY KEY (host, record, name)
    );
    """,
    # 4: the sites' pace per profile (supervisor/profiles/pg_pace.py, policy/pace.py admit):
    # a counter's due time and the interval it was counted at; one call takes every counter of
    # a request at once or none, on the database's clock
    """
    CREATE TABLE sfguard_pace (
        key text PRIMARY KEY,
        tat double precision NOT NULL,
        step double precision NOT NULL,
        updated double precision NOT NULL
    );
    CREATE FUNCTION sfguard_pace_take(keys text[], steps float8[], bursts int[], waits float8[],
                                      force boolean, OUT wait float8, OUT refused int, OUT retry float8,
                                      OUT worst float8)
    LANGUAGE plpgsql AS $$
    DECLARE
        now_s float8 := extract(epoch FROM clock_timestamp());
        n int := coalesce(array_length(keys, 1), 0);
        tats float8[] := '{}';
        i int; t float8; was float8; start float8; due float8;
    BEGIN
        wait := 0; refused := 0; retry := 0; worst := '-Infinity';
        FOR i IN 1..n LOOP
            INSERT INTO sfguard_pace (key, tat, step, updated) VALUES (keys[i], now_s, steps[i], now_s)
                ON CONFLICT (key) DO NOTHING;
            SELECT p.tat, p.step INTO t, was FROM sfguard_pace p WHERE p.key = keys[i] FOR UPDATE;
            IF t > now_s AND was > 0 AND was <> steps[i] THEN
                t := now_s + (t - now_s) * steps[i] / was;
                UPDATE sfguard_pace SET tat = t, step = steps[i], updated = now_s WHERE key = keys[i];
            END IF;
            start := greatest(t, now_s);
            due := start - (bursts[i] - 1) * steps[i] - now_s;
            worst := greatest(worst, due);
            IF NOT force AND due > waits[i] + 1e-9 THEN
                wait := 0; refused := i; retry := greatest(due, 0);
                RETURN;
            END IF;
            tats := tats || (start + steps[i]);
            wait := greatest(wait, due);
        END LOOP;
        FOR i IN 1..n LOOP
            UPDATE sfguard_pace SET tat = tats[i], step = steps[i], updated = now_s WHERE key = keys[i];
        END LOOP;
    END $$;
    """,
]

_MIGRATION_LOCK = 0x5F6775617264    # advisory lock id for schema changes ("_guard")


def migrate(conn, migrations: list[str] = MIGRATIONS) -> int:
    """Apply the missing migrations; returns the schema version. SchemaTooNew when the
    database was migrated by a newer sfguard (nothing is changed then)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS sfguard_schema_version ("
                     "version int PRIMARY KEY, applied double precision NOT NULL)")
        row = conn.execute("SELECT coalesce(max(version), 0) FROM sfguard_schema_version").fetchone()
        current = int(row[0])
        if current > len(migrations):
            raise SchemaTooNew(
                f"the database schema is version {current}, newer than this sfguard knows "
                f"(up to {len(migrations)}): upgrade sfguard on this host; nothing was changed")
        for version in range(current + 1, len(migrations) + 1):
            conn.execute(migrations[version - 1])
            conn.execute("INSERT INTO sfguard_schema_version (version, applied) VALUES (%s, %s)",
                         (version, time.time()))
            log.info("database schema migrated to version %d", version)
        return len(migrations)


def check_schema(conn, url_shown: str, migrations: list[str] = MIGRATIONS) -> int:
    """The schema version for a read-only command, changing nothing: NoSchema on a database
    without sfguard tables, SchemaTooNew / SchemaTooOld when it is not this sfguard's."""
    if conn.execute("SELECT to_regclass('sfguard_schema_version')").fetchone()[0] is None:
        raise NoSchema(f"the database {url_shown} has no sfguard schema: start a guard with "
                       "--store on it first (`sfguard start` creates the tables)")
    current = int(conn.execute("SELECT coalesce(max(version), 0) FROM "
                               "sfguard_schema_version").fetchone()[0])
    if current > len(migrations):
        raise SchemaTooNew(
            f"the database schema is version {current}, newer than this sfguard knows "
            f"(up to {len(migrations)}): upgrade sfguard on this host; nothing was changed")
    if current < len(migrations):
        raise SchemaTooOld(
            f"the database schema is version {current}, older than this sfguard "
            f"({len(migrations)}): start a guard of this version (`sfguard start --store ...`) "
            "to migrate it; read-only commands change nothing")
    return current
