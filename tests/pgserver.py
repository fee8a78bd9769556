"""A throw-away PostgreSQL server for tests and benchmarks (Debian's `postgresql` package).

`PgServer().start()` runs `initdb` and `pg_ctl start` in a fresh folder as an unprivileged
user (the `postgres` user of the Debian package when we are root, via `runuser`), trust
authentication, listening only on a unix socket in that folder (no TCP port). `stop()` runs
`pg_ctl stop -m fast`. `./dev` installs the package when it is missing.
"""
from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path


class PgMissing(RuntimeError):
    pass


def pg_bin() -> Path:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK) and os.access(os.path.join(d, "pg_ctl"), os.X_OK):
            return Path(d)
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    raise PgMissing("PostgreSQL (initdb, pg_ctl) not found: run ./dev setup, which installs the "
                    "Debian package 'postgresql'")


class PgServer:
    def __init__(self, *, fsync: bool = False):
        self.bin = pg_bin()
        # its own folder directly under /tmp: the server user must be able to reach it (a
        # pytest tmp folder is 0700 root's)
        self.base = Path(tempfile.mkdtemp(prefix="sfguard-pg-", dir="/tmp"))
        self.data = self.base / "data"
        self.sock = self.base / "sock"
        self.logfile = self.base / "postgres.log"
        self.fsync = fsync
        self.user = None
        if os.geteuid() == 0:
            try:
                self.user = pwd.getpwnam("postgres")
            except KeyError:
                raise PgMissing("running as root but there is no 'postgres' user (the Debian "
                                "package creates it): run ./dev setup") from None

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = list(argv)
        if self.user is not None:
            runuser = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin")
            cmd = [runuser or "runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=self.base, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})

    def start(self) -> PgServer:
        os.chmod(self.base, 0o700)
        self.sock.mkdir(mode=0o700, exist_ok=True)
        if self.user is not None:
            for p in (self.base, self.sock):
                os.chown(p, self.user.pw_uid, self.user.pw_gid)
        r = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
                      "postgres", "-E", "UTF8", "--no-sync")
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr[-2000:]}")
        return self.resume()

    def resume(self) -> PgServer:
        """pg_ctl start on the existing data folder (also after `pause`)."""
        opts = f"-k {self.sock} -c listen_addresses= -c max_connections=200"
        if not self.fsync:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        r = self._run(str(self.bin / "pg_ctl"), "start", "-D", str(self.data), "-w", "-t", "60",
                      "-l", str(self.logfile), "-o", opts)
        if r.returncode != 0:
            log = self.logfile.read_text(errors="replace")[-2000:] if self.logfile.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {r.stderr[-1000:]} {log}")
        return self

    def pause(self) -> None:
        """Stop the server but keep its data (the database is "unreachable" until `resume`).
        A clean (fast) shutdown: commits are asynchronous here (synchronous_commit=off), so an
        immediate one could lose the last ones."""
        r = self._run(str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast",
                      "-w", "-t", "60")
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed: {r.stderr[-1000:]}")

    def stop(self) -> None:
        """Stop the server (pg_ctl stop -m immediate: its folder is removed next, so no shutdown
        checkpoint is worth waiting for) and remove its folder."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate",
                          "-w", "-t", "60")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@/{db}?host={self.sock}"

    def create_db(self) -> str:
        """A fresh empty database; returns its URL."""
        import psycopg
        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
