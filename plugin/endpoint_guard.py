"""Who may use the control endpoints (status, reload): programs on this machine, not web pages.

- The peer is the socket's: a request that carries a proxy header (X-Forwarded-For, Forwarded,
  X-Real-IP) is refused, so a host's proxy-header handling cannot turn the peer into
  "localhost"; without such a header the host's client address is the socket's peer.
- The Host header must be a loopback name or the bind address: a page whose DNS name is
  rebound to 127.0.0.1 still sends its own name (DNS rebinding).
- A request with an Origin header comes from a web page; it is refused, and the answers carry
  no CORS allow-origin, so no page can read status or trigger a reload.
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


def refusal(peer: Optional[str], headers: Mapping[str, str], bind_host: Optional[str]) -> Optional[str]:
    """Why this request may not use a control endpoint, or None. `headers`: lower-case names."""
    if not loopback_address(peer):
        return "answers clients on this machine only (loopback)"
    forwarded = [h for h in FORWARDING_HEADERS if h in headers]
    if forwarded:
        return f"does not answer requests that carry proxy headers ({', '.join(forwarded)})"
    name = host_name(headers.get("host", ""))
    bind = (bind_host or "").strip("[]").lower()
    if not (name in LOOPBACK_NAMES or loopback_address(name) or (bind not in ANY_ADDRESS and name == bind)):
        return "answers requests addressed to localhost, a loopback address or the bind address only (Host header)"
    if "origin" in headers:
        return "does not answer web pages (Origin header); use `expert-stream status` or curl"
    return None


class ControlGuard:
    """ASGI wrapper (outside the host's CORS middleware) for the given paths: refuses what
    `refusal` refuses with a 403, and strips CORS headers from what it lets through."""

    def __init__(self, app, paths, bind_host: Optional[str]):
        self.app = app
        self.paths = frozenset(paths)
        self.bind_host = bind_host

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client = scope.get("client")
        why = refusal(client[0] if client else None, headers, self.bind_host)
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
