"""`sfguard proxy`: run a guard proxy in the foreground.

    sfguard proxy --allow 'example.com,*.example.org' [--policy FILE] [--listen 127.0.0.1:PORT]
                  [--client NAME:TOKEN ...] [--clients-file PATH] [--resolve HOST=IP ...]
                  [--decision-log FILE|-] [--listen-public] [--run ID]

Prints `ready http://HOST:PORT` once it accepts connections. Without any client it makes one
with a random token and prints the proxy URL with that credential on a second line. Clients
can also come from a 0600 clients file or the SFGUARD_PROXY_CLIENTS variable (see
docs/proxy.md) so that no token is visible in argv.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from sfguard import policy
from sfguard.cli.errors import CliError
from sfguard.proxy_addons import clients as clients_mod
from sfguard.proxy_addons.server import GuardConfig, GuardStartError
from sfguard.supervisor.daemon import proxy_child

logger = logging.getLogger("sfguard.proxy.cli")


def register(sub) -> None:
    p = sub.add_parser(
        "proxy", help="run a guard proxy (allowlist-enforcing HTTP proxy) in the foreground",
        description="Run a guard proxy. Prints 'ready http://HOST:PORT' when it accepts connections.")
    p.add_argument("--allow", action="append", default=[], metavar="PATTERNS",
                   help="allowed host patterns, comma separated; may be repeated")
    p.add_argument("--policy", metavar="FILE", help="site policy file (default: the shipped one)")
    p.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:0",
                   help="listen address (default 127.0.0.1 with a free port)")
    p.add_argument("--listen-public", action="store_true",
                   help="allow a listen address that is not loopback")
    p.add_argument("--client", action="append", default=[], metavar="NAME:TOKEN",
                   help="a client's proxy credentials; may be repeated (prefer --clients-file)")
    p.add_argument("--clients-file", metavar="PATH",
                   help="0600 file of clients (JSON list or NAME:TOKEN lines)")
    p.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                   help="resolve HOST to IP (comma separated IPs allowed), like curl's --resolve; "
                        "still subject to the address checks")
    p.add_argument("--decision-log", metavar="FILE|-",
                   help="write the decision log to FILE (append, 0600) or '-' for stdout")
    p.add_argument("--run", metavar="ID", help="run id written into decision log lines")
    p.add_argument("--head-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a new connection has to send its first request head (default 10)")
    p.set_defaults(func=run)


def _split_patterns(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        out.extend(part.strip() for part in v.replace(" ", ",").split(",") if part.strip())
    return out


def _parse_listen(text: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("0" if not rest else None)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.isdigit():
        host, port_text = "127.0.0.1", text
    else:
        host, port_text = text, "0"
    if port_text is None or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise CliError(f"--listen {text!r}: expected HOST:PORT with an IP address and a port 0-65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise CliError(f"--listen {text!r}: the host must be an IP address such as 127.0.0.1") from None
    return host, int(port_text)


def _parse_resolve(values: list[str]) -> dict[str, list[str]]:
    try:
        return policy.parse_resolve(values)
    except ValueError as exc:
        raise CliError(f"--resolve {exc}") from None


def _build_clients(args, allow: list[str]) -> tuple[list[clients_mod.Client], str | None]:
    """Clients from --client, --clients-file and $SFGUARD_PROXY_CLIENTS; else one random one.

    Returns the clients and, for a generated client, its NAME:TOKEN (to print once).
    """
    found: list[clients_mod.Client] = []
    try:
        for cred in args.client:
            name, token = clients_mod.parse_credential(cred)
            found.append(clients_mod.make_client(name, token, allow, run=args.run))
        if args.clients_file:
            text = clients_mod.load_clients_file(args.clients_file)
            found.extend(clients_mod.load_clients_text(text, args.clients_file, allow))
        env = os.environ.get(clients_mod.CLIENTS_ENV)
        if env:
            found.extend(clients_mod.load_clients_text(env, clients_mod.CLIENTS_ENV, allow))
    except clients_mod.ClientSpecError as exc:
        raise CliError(str(exc)) from None
    if found:
        return found, None
    name, token = "operator", clients_mod.new_token()
    return [clients_mod.make_client(name, token, allow, run=args.run)], f"{name}:{token}"


def run(args) -> int:
    allow = _split_patterns(args.allow)
    host, port = _parse_listen(args.listen)
    try:
        policy.compile_patterns(allow, source="--allow")
    except policy.PolicyError as exc:
        raise CliError(str(exc).replace("\n", "; ")) from None
    resolve = _parse_resolve(args.resolve)
    if args.head_timeout <= 0:
        raise CliError("--head-timeout must be positive")
    clients, generated = _build_clients(args, allow)
    config = GuardConfig(listen_host=host, listen_port=port, listen_public=args.listen_public,
                         policy_path=args.policy, resolve=resolve,
                         decision_log=args.decision_log, run=args.run,
                         head_timeout=args.head_timeout)
    try:
        config.check()
    except GuardStartError as exc:
        raise CliError(str(exc)) from None
    proxy_child.install_logging(run_proxy=False)
    try:
        return proxy_child.serve(config, clients, credential=generated)
    except proxy_child.ProxyProcessError as exc:
        raise CliError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """`python -m sfguard.cli.proxy_cmd ARGS`: the same command without loading every other command.

    `sfguard proxy` builds the parser of every sfguard command (and imports their modules);
    this entry point parses only the proxy's flags, which keeps the process small. Arguments,
    output and exit codes are identical. Either way the proxy itself runs in
    `sfguard.supervisor.daemon.proxy_child.serve`, the function the daemon's per-run proxies run.
    """
    parser = argparse.ArgumentParser(prog="sfguard")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(["proxy", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"sfguard proxy: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
