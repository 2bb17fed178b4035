"""This host's network interface and address for a multi-node job, chosen from the routing table.

gloo (and NCCL's bootstrap) find their own address by resolving the host name. On Debian and Ubuntu the
host name resolves to 127.0.1.1 (`/etc/hosts`), so a rank publishes a loopback address, the other nodes
cannot connect to it, and the job hangs in its first collective with no message. The kernel already knows
the right answer: the source address of a packet to the rendezvous endpoint. Connecting a UDP socket asks
the routing table for it without sending anything; the interface holding that address (psutil's
`net_if_addrs`) is the one the job must use. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when set, win.

The same answers tell torchrun what it needs on such a host: `--local-addr` (the address the other nodes
reach this one at, published by the rank-0 node as MASTER_ADDR) and, on the rendezvous host when the
endpoint is an address rather than the host's own name, `--rdzv-conf is_host=1` (torch recognises the
host by resolving its name, which gives 127.0.1.1 there).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from scaletrain.errors import UserError

SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class NetChoice:
    """The interface a rank's gloo/NCCL sockets use, its address, and why it was chosen."""

    interface: str
    address: str
    reason: str


def split_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    """`host:port`, `host` (torchrun's default port), `[v6addr]:port` -> (host, port); a bad one is a UserError."""
    host, port = endpoint.strip(), str(default_port)
    if host.startswith("["):
        inner, _, rest = host[1:].partition("]")
        host, port = inner, rest.removeprefix(":") if rest else port
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT with a port in 1-65535")
    return host, int(port)


def interfaces() -> dict[str, list[str]]:
    """{interface: [IPv4 and IPv6 addresses]} of this host (link-local IPv6 left out)."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and not a.address.lower().startswith("fe80"):
                out.setdefault(name, []).append(a.address.split("%")[0])
    return out


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> list[str]:
    """Addresses `host` resolves to on this machine, in resolver order (IPv4 first), or []."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    seen: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            if info[0] == family and info[4][0] not in seen:
                seen.append(info[4][0])
    return seen


def source_address(target: str) -> str | None:
    """The local address the kernel would send from to reach `target` (no packet is sent), or None."""
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str, table: Mapping[str, list[str]] | None = None) -> str | None:
    for name, addrs in (table if table is not None else interfaces()).items():
        if address in addrs:
            return name
    return None


def from_variable(var: str, environ: Mapping[str, str] | None = None) -> NetChoice | None:
    """The user's choice in `var` (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), checked to exist here."""
    environ = os.environ if environ is None else environ
    value = environ.get(var, "").strip()
    if not value:
        return None
    table = interfaces()
    names = [n.strip() for n in value.removeprefix("^").removeprefix("=").split(",") if n.strip()]
    if value.startswith("^"):  # NCCL's exclusion syntax: leave the choice to the library
        return NetChoice(value, "", f"{var}={value} (set by the user)")
    missing = [n for n in names if n not in table]
    if missing or not names:
        raise UserError(f"{var}={value} names no interface of this host ({socket.gethostname()}: "
                        f"{', '.join(sorted(table)) or 'none'})")
    addrs = table[names[0]]
    return NetChoice(value, addrs[0] if addrs else "", f"{var}={value} (set by the user)")


def route_to(host: str) -> NetChoice:
    """The interface and address that route to `host` (a name or an address)."""
    targets = resolve(host)
    if not targets:
        raise UserError(f"cannot resolve {host!r} on this host ({socket.gethostname()}); use its address, or "
                        "add it to /etc/hosts or DNS")
    table = interfaces()
    for target in targets:
        src = source_address(target)
        if src is None:
            continue
        name = interface_of(src, table) or "?"
        shown = target if target == host else f"{host} = {target}"
        return NetChoice(name, src, f"routes to {shown}")
    raise UserError(f"no route from this host ({socket.gethostname()}) to {host} ({', '.join(targets)})")


def is_this_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine: loopback, or one of its interface addresses."""
    addrs = resolve(host)
    mine = {a for addrs_ in interfaces().values() for a in addrs_}
    return bool(addrs) and any(is_loopback(a) or a in mine for a in addrs)


def hostname_report() -> tuple[str, list[str]]:
    """(host name, the addresses it resolves to here): a loopback-only answer is Debian's 127.0.1.1 trap."""
    name = socket.gethostname()
    return name, resolve(name)


def net_identity() -> str:
    """Which network stack this process is in: the boot id and the network namespace. Two processes with the same
    identity reach each other over loopback (nodes of one job that share a host, the way multi-node is first tried),
    processes on other machines or in other namespaces do not."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        ns = "?"
    return f"{boot}/{ns}"
