"""What both hosts' routes serve for a person or a monitoring stack: the status page
(status_page.html beside this file, one self-contained file: inline script and style, no
external assets, so it works offline) and the Prometheus metrics (plugin/metrics.py).

The page's script is allowed by its hash (Content-Security-Policy): the browser runs that
script and nothing else, loads nothing from elsewhere, and connects to this server only."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

PAGE_PATHS = ("/expert-stream/", "/expert-stream")
METRICS_PATH = "/expert-stream/metrics"


@lru_cache(maxsize=1)
def page() -> tuple[bytes, dict]:
    """(body, headers) of the status page."""
    body = resources.files("expert_stream.plugin.hosts").joinpath("status_page.html").read_bytes()
    scripts = re.findall(rb"<script>(.*?)</script>", body, re.S)
    hashes = " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(s).digest()).decode() for s in scripts)
    policy = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
              "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return body, {"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": policy,
                  "X-Frame-Options": "DENY", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def metrics(status: dict) -> tuple[bytes, dict]:
    """(body, headers) of a Prometheus scrape of `status`."""
    from expert_stream.plugin.metrics import exposition

    body, content_type = exposition(status)
    return body, {"Content-Type": content_type, "Cache-Control": "no-store"}
