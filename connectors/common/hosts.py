"""Hosts in addresses: the one place that validates a host, brackets IPv6 literals (`[fd00::1]:8000`,
`tcp://[::1]:5000`) and splits `host:port`, and this node's own address (`local_host`).

Hosts travel bare (VLLM_HOST_IP, --master-addr, Mooncake's local_hostname all take `fd00::1`); only
where a port or a scheme is joined to one does it need brackets, and every such join goes through
`join_host_port`.
"""

from __future__ import annotations

import ipaddress
import os
import re

from kvpp_core.config import shown

_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: object) -> str | None:
    """Why `host` cannot be given to a peer as this node's address, or None: an IP literal (IPv6 bare, as
    VLLM_HOST_IP holds it) or a DNS name. Scoped IPv6 addresses name an interface of their own host (and
    would need %25 in URLs); brackets belong to `join_host_port`, never to the host itself."""
    if not isinstance(host, str) or not host:
        return "must be a non-empty host name or IP address"
    if "%" in host:
        return (f"{shown(host)}: a scoped IPv6 address (%zone) names an interface of one host, which peers on "
                "other hosts cannot use; give a global or unique-local address (e.g. fd00::11)")
    if host.startswith("["):
        return (f"{shown(host)}: write a host without brackets (they are added where a port follows); as "
                "written it is neither an IP address nor a DNS name")
    if ip_version(host) is not None:
        return None
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        return (f"{shown(host)} is neither an IP address nor a DNS name (letters, digits, '-' and '.' only; no "
                "spaces, quotes or control characters)")
    return None


def local_host() -> str:
    """This node's address, where peers reach it (both connectors publish it): VLLM_HOST_IP when set,
    else loopback."""
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def ip_version(host: str) -> int | None:
    """4 or 6 for an IP literal, None for a host name."""
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def is_ipv6(host: str) -> bool:
    return ip_version(host) == 6


def join_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def host_url(scheme: str, host: str, port: int) -> str:
    """`scheme://host:port`, an IPv6 literal in brackets."""
    return f"{scheme}://{join_host_port(host, port)}"


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[ipv6]:port`; ValueError saying what is wrong. The host comes
    back bare (no brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 1 <= int(port[:6]) <= 65535:
        raise ValueError("must be host:port with a port from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        if not is_ipv6(host[1:-1]):
            raise ValueError(f"{host} is not a bracketed IPv6 address")
        return host[1:-1], int(port)
    if ":" in host:
        raise ValueError(f"an IPv6 address takes brackets before the port: [{host}]:{port}")
    return host, int(port)


def address_problem(address: str) -> str | None:
    """Why `address` is not a `host:port` (an IPv6 literal in brackets) whose host peers can reach, or None."""
    try:
        host, _ = split_host_port(address)
    except ValueError as exc:
        if is_ipv6(address) and not is_ipv6(address.rpartition(":")[0]):  # `fd00::9`: no port at all
            return f"an IPv6 address takes brackets and a port: [{address}]:PORT"
        return str(exc)
    problem = host_problem(host)
    return f"host {problem}" if problem else None


def canonical_host(host: str) -> str:
    """One spelling per host, to compare hosts written differently (`FD00:0::1` is `fd00::1`)."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().rstrip(".")


def wildcard(hosts: list[str] | tuple[str, ...]) -> str:
    """The listen address that serves `hosts`: `::` when one of them is an IPv6 literal, else
    `0.0.0.0`. vLLM binds `::` as one dual-stack socket (IPv4 too, unless the host sets
    net.ipv6.bindv6only); `kvpp proxy` adds `0.0.0.0` to it itself."""
    return "::" if any(is_ipv6(h) for h in hosts) else "0.0.0.0"


MOONCAKE_IPV6 = "MC_USE_IPV6"
"""Mooncake's transfer engine reaches IPv6 peers only with MC_USE_IPV6=1, and then no IPv4 peer
(measured with mooncake-transfer-engine 0.3.13: a batch read between two IPv4 engines fails with -1
in that mode): one Mooncake deployment is IPv4 or IPv6, never both."""


def mooncake_family(host: str, environ: dict[str, str]) -> None:
    """Put Mooncake in the mode `host` (this process's own address) needs: IPv6 mode for an IPv6
    literal; ValueError for an IPv4 literal in an IPv6-mode process. The library reads the variable
    when it loads, so call this before importing it (rendered deployments also set it up front)."""
    if is_ipv6(host):
        environ.setdefault(MOONCAKE_IPV6, "1")
    elif environ.get(MOONCAKE_IPV6, "0") not in ("", "0") and ip_version(host) == 4:
        raise ValueError(f"{MOONCAKE_IPV6}={environ[MOONCAKE_IPV6]} puts Mooncake in IPv6 mode, where it cannot "
                         f"reach IPv4 peers, but this process's address is {host}; unset {MOONCAKE_IPV6} or give it "
                         "(VLLM_HOST_IP) an IPv6 address")
