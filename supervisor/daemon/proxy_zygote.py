"""The runs' proxies forked from one pre-loaded parent (a "zygote"), so that a run's proxy
shares the pages of mitmproxy, our addons and the policy code with every other run's.

The zygote imports everything, starts and stops one proxy without clients, freezes its objects
(`gc.freeze`) and then only forks: each child is the same process as a separately started
`proxy_child` (same `main`, argv, stdin control protocol), in its own session. The zygote holds
no client and no credential.

Protocol, over a SOCK_SEQPACKET socket pair (`--ctl-fd` in the zygote), one JSON object per message:

  daemon -> zygote  {"id": N, "argv": [...proxy_child args], "nice": K}  + fds [stdin, stdout]
  zygote -> daemon  {"ready": true}  once, after the warm-up
                    {"id": N, "pid": P}  + fd [pidfd of P]   or   {"id": N, "error": "..."}

The daemon watches and signals each child through its pidfd (never a bare pid that the kernel
may have reused). The zygote reaps its children. When the daemon's end closes (the guard
stopped or died), the zygote exits; its children end when their stdin closes, as before.
`SFGUARD_PROXY_ZYGOTE=0` starts each proxy as its own process.

Why fork, what it saves (measured) and why isolation stays per process:
docs/decisions/0032-proxies-forked-from-a-zygote.md.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

from sfguard.errors import SfguardError
from sfguard.supervisor import redaction
from sfguard.supervisor.errors import BrowserStartError
from sfguard.supervisor.procs import ProcRecord, end_child

log = logging.getLogger("sfguard.guard")

MAX_MSG = 1 << 20
START_TIMEOUT = 30.0
#: SFGUARD_PROXY_ZYGOTE=0: every run's proxy is started as its own process (the old way; the
#: capacity benchmark's comparison, and a way out should forking ever misbehave somewhere)
ENV_SWITCH = "SFGUARD_PROXY_ZYGOTE"


class ZygoteError(BrowserStartError):
    """The zygote could not start or could not fork a proxy (one line, no secrets); the run's
    proxy is then started as a process of its own."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


# --------------------------------------------------------------------------- daemon side

class ForkedProxy:
    """A proxy process forked by the zygote, seen by the daemon as an asyncio child: `pid`,
    `stdin`, `stdout`, `returncode`, `wait()`, `send_signal()`. The daemon is not its parent,
    so it watches and signals it through a pidfd; `returncode` is -1 once it has ended (its
    exit status goes to the zygote, which reaps it; why it ended is in its own stderr lines)."""

    def __init__(self, pid: int, pidfd: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader,
                 stdout_transport: asyncio.BaseTransport):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self._stdout_transport = stdout_transport
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd
        self._ended = asyncio.Event()
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit)

    def _on_exit(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self.returncode = -1
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        return -1

    def send_signal(self, sig: int) -> None:
        if self._pidfd is None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def close(self) -> None:
        """Stop watching (the guard is stopping); the process is ended by `end_child` first."""
        self.stdin.close()
        self._stdout_transport.close()
        if self._pidfd is not None:
            self._on_exit()


class Zygote:
    """The daemon's handle on the zygote: started on first use, started again when it died."""

    def __init__(self, policy_path: Path, decision_log: Path):
        self.policy_path, self.decision_log = policy_path, decision_log
        self.proc: asyncio.subprocess.Process | None = None
        self.record: ProcRecord | None = None
        self._sock: socket.socket | None = None
        self._seq = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._lock = asyncio.Lock()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self._sock is not None

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "TMPDIR", "SFGUARD_HOME", "PYTHONPATH",
                        redaction.LOG_FORMAT_ENV)}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-O", "-m", "sfguard.supervisor.daemon.proxy_zygote",
                "--policy", str(self.policy_path), "--decision-log", str(self.decision_log),
                "--ctl-fd", str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=None,
                env=env, start_new_session=True, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.record = ProcRecord.of(self.proc.pid, "proxy")
        self._sock = ours
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_message)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except (TimeoutError, ZygoteError):
            await self.stop()
            raise ZygoteError("the proxy zygote did not start") from None

    def _on_message(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:   # the zygote is gone: fail whatever waits for it
            self._detach()
            return
        msg = json.loads(data)
        if msg.get("ready") and self._ready is not None and not self._ready.done():
            self._ready.set_result(True)
            return
        fut = self._waiting.pop(msg.get("id"), None)
        if fut is None or fut.done():
            for fd in fds:
                os.close(fd)
            return
        fut.set_result((msg, fds))

    def _detach(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(RuntimeError, ValueError):   # no loop any more / closed
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for fut in [*self._waiting.values(), self._ready]:
            if fut is not None and not fut.done():
                fut.set_exception(ZygoteError("the proxy zygote ended"))
        self._waiting.clear()

    async def spawn(self, args: list[str], nice: int = 0) -> ForkedProxy:
        """Fork one proxy child running `proxy_child.main(args)`, its stdin and stdout piped
        to us as an asyncio child's would be."""
        async with self._lock:
            if not self.alive():
                await self.stop()
                await self._start()
            sock = self._sock
            assert sock is not None
            self._seq += 1
            fut = asyncio.get_running_loop().create_future()
            self._waiting[self._seq] = fut
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                socket.send_fds(sock, [json.dumps({"id": self._seq, "argv": args, "nice": nice}).encode()],
                                [in_r, out_w])
                sent = True
            except OSError:
                sent = False
            finally:
                os.close(in_r)    # the child has its own copies now (or never will)
                os.close(out_w)
            if not sent:
                os.close(in_w)
                os.close(out_r)
                self._waiting.pop(self._seq, None)
                raise ZygoteError("the proxy zygote did not take the request")
        try:
            msg, fds = await asyncio.wait_for(fut, START_TIMEOUT)
        except (TimeoutError, ZygoteError):
            os.close(in_w)
            os.close(out_r)
            raise ZygoteError("the proxy zygote did not fork the run's proxy") from None
        if "pid" not in msg or len(fds) != 1:
            for fd in (in_w, out_r, *fds):
                os.close(fd)
            raise ZygoteError(f"the proxy zygote could not fork: {msg.get('error', 'no pidfd')}")
        return await _attach(msg["pid"], fds[0], in_w, out_r)

    async def stop(self) -> None:
        self._detach()
        proc, self.proc = self.proc, None
        if proc is not None:
            await end_child(proc, 5)


async def _attach(pid: int, pidfd: int, in_w: int, out_r: int) -> ForkedProxy:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_MSG)
    read_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                     os.fdopen(out_r, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(in_w, "wb", 0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return ForkedProxy(pid, pidfd, writer, reader, read_transport)


# --------------------------------------------------------------------------- zygote side

def _warm(policy_path: str, decision_log: str) -> None:
    """Load everything a run's proxy loads, by starting and stopping one proxy with no client
    (it is never given a credential, so it could not serve a request if one came)."""
    from sfguard.proxy_addons.clients import ClientRegistry, make_client
    from sfguard.proxy_addons.server import GuardConfig, GuardProxy

    async def once() -> None:
        config = GuardConfig(listen_port=0, policy_path=Path(policy_path), resolve={},
                             decision_log=None, run=None)   # the refused warm-up request is logged nowhere
        token = secrets.token_urlsafe(24)
        proxy = GuardProxy(config, ClientRegistry([make_client("warm", token, [])], loaded=True))
        host, port = await proxy.start()
        try:   # one request the proxy refuses (no allowlist): the request path is loaded too
            reader, writer = await asyncio.open_connection(host, port)
            auth = base64.b64encode(f"warm:{token}".encode()).decode()
            writer.write(f"CONNECT warm.invalid:443 HTTP/1.1\r\nHost: warm.invalid:443\r\n"
                         f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
            await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
        finally:
            await proxy.stop()

    logging.disable(logging.CRITICAL)
    try:
        asyncio.run(once())
    except (SfguardError, OSError, ValueError) as exc:   # a bad policy now is reported by the child that loads it
        print(redaction.log_line(f"sfguard-proxy-zygote: warm-up skipped ({type(exc).__name__})",
                                 logger="sfguard.proxy.zygote", level="WARNING"), file=sys.stderr)
    finally:
        logging.disable(logging.NOTSET)


def _child(ctl: socket.socket, fds: list[int], args: list[str]) -> None:
    """In the forked child: become a run's proxy process. Never returns."""
    code = 70
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # as Python sets them at start: SIGPIPE ignored (a write to a connection the browser
        # closed raises BrokenPipeError; SIG_DFL would end the whole proxy), SIGINT raising
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ctl.close()
        os.setsid()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        for fd in fds:
            os.close(fd)
        from sfguard.supervisor.daemon import proxy_child
        code = proxy_child.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:   # the child ends here (70 unless main returned), never returns into the zygote loop
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(*_: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def main(argv: list[str] | None = None) -> int:
    import argparse
    import gc

    p = argparse.ArgumentParser(prog="sfguard-proxy-zygote")
    p.add_argument("--policy", required=True)
    p.add_argument("--decision-log", required=True)
    p.add_argument("--ctl-fd", type=int, required=True)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    ctl = socket.socket(fileno=a.ctl_fd)
    from sfguard.supervisor.daemon import proxy_child  # noqa: F401 - the imports every child shares
    _warm(a.policy, a.decision_log)
    gc.collect()
    gc.freeze()         # what is loaded now stays in shared pages: no collector pass writes to it
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    ctl.sendmsg([b'{"ready": true}'])
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MSG, 2)
        except InterruptedError:
            continue
        if not data:
            return 0    # the daemon is gone
        try:
            msg = json.loads(data)
            args, nice = [str(x) for x in msg["argv"]], int(msg.get("nice", 0))
            if len(fds) != 2:
                raise ValueError("two pipe ends expected")
        except (ValueError, KeyError, TypeError) as exc:
            for fd in fds:
                os.close(fd)
            ctl.sendmsg([json.dumps({"id": None, "error": type(exc).__name__}).encode()])
            continue
        # SIGCHLD held from the fork until the pidfd exists: no reap in between, so the pidfd
        # names exactly this child even if it ended at once
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            pid = os.fork()
            if pid == 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                _child(ctl, fds, args)
            pidfd = os.pidfd_open(pid)
            if nice:    # set here, before the guard learns the pid: its later renice then wins
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError as exc:
            ctl.sendmsg([json.dumps({"id": msg.get("id"), "error": exc.strerror or "fork"}).encode()])
            continue
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(ctl, [json.dumps({"id": msg.get("id"), "pid": pid}).encode()], [pidfd])
        finally:
            os.close(pidfd)


if __name__ == "__main__":
    sys.exit(main())
