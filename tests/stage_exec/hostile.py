"""A hostile stage: what it can find and read with a shell. Run by the tests inside
`sfguard stage-exec` and, without it, as another OS user. Prints one JSON document.

argv[1]: a JSON file naming what to attack (paths, pids, ports); nothing secret is in it."""
import json
import os
import socket
import sys

target = json.load(open(sys.argv[1]))
out = {"uid": os.getuid(), "listening": [], "open_ports": [], "devtools": [], "files": {},
       "sockets": {}, "environ": {}, "cmdlines": {}, "mem": {}, "direct": {}}

for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        for line in open(name).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                out["listening"].append(int(f[1].rsplit(":", 1)[1], 16))
    except OSError as exc:
        out["listening_error"] = type(exc).__name__

ports = set(out["listening"])
if target.get("full_scan"):
    for port in range(1, 65536):
        s = socket.socket()
        s.settimeout(0.2)
        try:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                ports.add(port)
        finally:
            s.close()
for port in sorted(ports):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            out["open_ports"].append(port)
            s.settimeout(3)
            s.sendall(b"GET /json/version HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while len(data) < 65536 and b"webSocketDebuggerUrl" not in data:
                try:
                    chunk = s.recv(4096)
                except OSError:  # servers that keep the connection open: judge what came
                    break
                if not chunk:
                    break
                data += chunk
        if b"webSocketDebuggerUrl" in data:
            out["devtools"].append(port)
    except OSError:
        pass

for path in target["paths"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as fh:
                fh.read(16)
        out["files"][path] = "READ"
    except OSError as exc:
        out["files"][path] = type(exc).__name__

for path in target["sockets"]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    try:
        s.connect(path)
        out["sockets"][path] = "CONNECTED"
    except OSError as exc:
        out["sockets"][path] = type(exc).__name__
    finally:
        s.close()

pids = {p for p in os.listdir("/proc") if p.isdigit()} | {str(p) for p in target["pids"]}
for pid in sorted(pids, key=int):
    try:
        out["environ"][pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError as exc:
        out["environ"][pid] = "ERR " + type(exc).__name__
    try:
        out["cmdlines"][pid] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError as exc:
        out["cmdlines"][pid] = "ERR " + type(exc).__name__
for pid in target["pids"]:
    try:
        with open(f"/proc/{pid}/mem", "rb") as fh:
            fh.read(1)
        out["mem"][str(pid)] = "OPENED"
    except OSError as exc:
        out["mem"][str(pid)] = type(exc).__name__

for host, port in target["direct"]:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        out["direct"][f"{host}:{port}"] = "CONNECTED"
    except OSError as exc:
        out["direct"][f"{host}:{port}"] = type(exc).__name__
    finally:
        s.close()

print(json.dumps(out))
