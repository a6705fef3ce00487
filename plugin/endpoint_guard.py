"""Who may use the control endpoints (status, reload): programs on this machine, not web pages.

- The peer is the socket's: a request that carries a proxy header (X-Forwarded-For, Forwarded,
  X-Real-IP) is refused, so a host's proxy-header handling cannot turn the peer into
  "localhost"; without such a header the host's client address is the socket's peer.
- The Host header must be a loopback name or the bind address: a page whose DNS name is
  rebound to 127.0.0.1 still sends its own name (DNS rebinding).
- A request with an Origin header comes from a web page; it is refused, and the answers carry
  no CORS allow-origin, so no page can read status or trigger a reload.
- The metrics endpoint alone may also answer the addresses of `metrics_allow` (a Prometheus
  server elsewhere): such a peer must address the server by an IP address or the bind address
  (Host header), which a rebound DNS name cannot be.
`ControlGuard` applies this to an ASGI app (mlx-openai-server); `refusal` is the check itself,
for hosts that dispatch requests themselves (mlx_lm.server)."""

from __future__ import annotations

import ipaddress
import json
from typing import Mapping, Optional

FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip", "x-forwarded-host")
LOOPBACK_NAMES = {"localhost", "localhost."}
ANY_ADDRESS = {"", "0.0.0.0", "::", "[::]"}


def loopback_address(peer: Optional[str]) -> bool:
    """True for an IP address on the loopback interface (127/8, ::1, ::ffff:127.x)."""
    try:
        ip = ipaddress.ip_address((peer or "").strip("[]"))
    except ValueError:
        return False  # a name is not a peer address
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def host_name(host_header: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def allow_list(value, where: str) -> tuple[str, ...]:
    """`metrics_allow`: IP addresses or networks (10.0.0.5, 10.0.0.0/24, fd00::/8), normalized;
    ValueError naming `where` for anything else (a host name: peers are checked by address)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: must be a list of IP addresses or networks, got {value!r}")
    out = []
    for item in value:
        try:
            out.append(str(ipaddress.ip_network(str(item).strip("[]"), strict=False)))
        except ValueError:
            raise ValueError(f"{where}: {item!r} is not an IP address or network (e.g. 10.0.0.5 or "
                             "10.0.0.0/24); host names are not accepted, the peer is checked by address") from None
    return tuple(out)


def _in_networks(peer: Optional[str], networks) -> bool:
    try:
        ip = ipaddress.ip_address((peer or "").strip("[]"))
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return any(ip in ipaddress.ip_network(n) for n in networks)


def refusal(peer: Optional[str], headers: Mapping[str, str], bind_host: Optional[str],
            allowed=()) -> Optional[str]:
    """Why this request may not use a control endpoint, or None. `headers`: lower-case names;
    `allowed`: networks (allow_list) that may use it besides this machine."""
    local = loopback_address(peer)
    if not local and not _in_networks(peer, allowed):
        return "answers clients on this machine only (loopback)" + (" and metrics_allow" if allowed else "")
    forwarded = [h for h in FORWARDING_HEADERS if h in headers]
    if forwarded:
        return f"does not answer requests that carry proxy headers ({', '.join(forwarded)})"
    name = host_name(headers.get("host", ""))
    bind = (bind_host or "").strip("[]").lower()
    if not (name in LOOPBACK_NAMES or loopback_address(name) or (bind not in ANY_ADDRESS and name == bind)
            or (not local and _is_address(name))):
        return "answers requests addressed to localhost, a loopback address or the bind address only (Host header)"
    if "origin" in headers:
        return "does not answer web pages (Origin header); use `expert-stream status` or curl"
    return None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class ControlGuard:
    """ASGI wrapper (outside the host's CORS middleware) for the given paths: refuses what
    `refusal` refuses with a 403, and strips CORS headers from what it lets through.
    `allowed(path)`: the networks that path may also answer (read at each request: a reload
    changes them)."""

    def __init__(self, app, paths, bind_host: Optional[str], allowed=lambda path: ()):
        self.app = app
        self.paths = frozenset(paths)
        self.bind_host = bind_host
        self.allowed = allowed

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client = scope.get("client")
        why = refusal(client[0] if client else None, headers, self.bind_host, self.allowed(scope["path"]))
        if why:
            body = json.dumps({"error": f"{scope['path']} {why}"}).encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return

        async def send_without_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if not k.lower().startswith(b"access-control-")]}
            await send(message)

        await self.app(scope, receive, send_without_cors)
