"""Static files shipped inside the package, served with a strict Content-Security-Policy.

The files are read once (a few tens of KB) and served from memory: no path from a request
ever reaches the file system, so there is nothing to traverse.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response

# Everything from this origin only: no CDN, no inline script or style, no frames, no forms
# posting elsewhere. The page works offline, and injected markup cannot run.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


class StaticBundle:
    """The files of one package folder (flat), by name."""

    def __init__(self, package: str, folder: str):
        root: Traversable = resources.files(package) / folder
        self._files: dict[str, tuple[bytes, str, str]] = {}
        for entry in root.iterdir():
            suffix = "." + entry.name.rsplit(".", 1)[-1]
            if not entry.is_file() or suffix not in MEDIA_TYPES:
                continue
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            self._files[entry.name] = (body, MEDIA_TYPES[suffix], etag)
        if "index.html" not in self._files:
            raise FileNotFoundError(f"{package}/{folder} has no index.html (is it installed?)")

    @property
    def names(self) -> list[str]:
        return sorted(self._files)

    def response(self, name: str, request: Request) -> Response | None:
        """The file, or None when there is no such file."""
        found = self._files.get(name)
        if found is None:
            return None
        body, media_type, etag = found
        # Revalidate every time (cheap: a 304), so an upgraded coordinator is seen at once.
        headers = {**SECURITY_HEADERS, "ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(body, media_type=media_type, headers=headers)
