"""Rendering a report in a real headless browser (Debian's chromium) with the network cut off.

The page writes a JSON verdict into ``<pre id="selftest">`` once every figure is drawn (see
``mlaunch/trace/report/assets/report.js``): page errors, and per figure the DOM elements plotly
created. ``--dump-dom`` returns the DOM after load and the virtual-time budget, so reading that
element back needs no DevTools client.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.apt import apt_install

#: Where screenshots go (gitignored): the repository root's test-artifacts/.
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

#: No host name resolves (but the trap's loopback address); every http(s) request goes to the
#: proxy, a loopback trap that answers nothing.
OFFLINE_FLAGS = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
#: Chromium pings these on its own (clock, updates, accounts) whatever the page: not the page's.
BROWSER_OWN_HOSTS = ("google.com", "googleapis.com")


class Trap:
    """A loopback "proxy" that answers nothing and records every request made to it, so a test
    sees any fetch the page (or the browser) attempted while offline."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    first = conn.recv(4096).split(b"\r\n", 1)[0]
                except OSError:
                    first = b"?"
                # Chromium preconnects to its proxy and closes the socket unused when nothing
                # needs it (seen under load, when the page outruns the speculative socket): a
                # connection that sent no bytes carried no request.
                if first:
                    self.requests.append(first.decode("latin-1"))

    def close(self) -> None:
        self.sock.close()


def _chromium() -> str | None:
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )


def find_or_install_chromium() -> tuple[str | None, str]:
    """The chromium binary, installing Debian's package when missing: (path, why not)."""
    why = apt_install(["chromium"], lambda: _chromium() is not None)
    return (_chromium(), "") if not why else (None, why)


@dataclass
class Rendered:
    """What the browser saw."""

    verdict: dict[str, Any]
    stderr: str
    fetches: list[str]  # requests that reached the offline trap (should be none)

    def figure(self, div: str) -> list[dict[str, Any]]:
        """The drawn traces of one figure (name, type, points, lines, ids)."""
        return self.verdict["figures"][div]

    def trace(self, div: str, name: str) -> dict[str, Any]:
        """One drawn trace of a figure, by name."""
        return next(t for t in self.figure(div) if t["name"] == name)


def _base(chromium: str, profile: Path, trap: Trap) -> list[str]:
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
        f"--user-data-dir={profile}", "--virtual-time-budget=30000", *OFFLINE_FLAGS,
        f"--proxy-server=http://127.0.0.1:{trap.port}",
    ]  # fmt: skip


def render(chromium: str, page: Path, profile: Path, screenshot: Path | None = None) -> Rendered:
    """Load ``page`` offline, return the self-test verdict; optionally save a screenshot."""
    url = page.resolve().as_uri()
    trap = Trap()
    try:
        cmd = [*_base(chromium, profile, trap), "--enable-logging=stderr", "--v=0",
               "--dump-dom", url + "#selftest"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        m = re.search(r'<pre id="selftest"[^>]*data-done="1"[^>]*>(.*?)</pre>', r.stdout, re.S)
        assert m, "the page never finished its self-test:\n" + r.stderr[-2000:]
        verdict = json.loads(html.unescape(m.group(1)))
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            shot = [*_base(chromium, profile, trap), "--window-size=1400,2600",
                    f"--screenshot={screenshot}", url]  # fmt: skip
            s = subprocess.run(shot, capture_output=True, text=True, timeout=180)
            assert s.returncode == 0 and screenshot.stat().st_size > 10_000, s.stderr[-2000:]
    finally:
        trap.close()
    return Rendered(verdict, r.stderr, page_fetches(trap.requests))


def page_fetches(requests: list[str]) -> list[str]:
    """The trapped requests (``CONNECT host:443 ...`` / ``GET http://host/...``) not made by the
    browser itself."""
    out = []
    for req in requests:
        m = re.match(r"\S+ (?:https?://)?([^/:\s]+)", req)
        host = m.group(1) if m else ""
        if not any(host == h or host.endswith("." + h) for h in BROWSER_OWN_HOSTS):
            out.append(req)
    return out


def console_problems(stderr: str) -> list[str]:
    """Console messages of the page that report an error (chromium logs the page's console to
    stderr with ``--enable-logging``); the browser's own dbus noise is not one."""
    return [
        line for line in stderr.splitlines()
        if "CONSOLE" in line and ("Uncaught" in line or "rror" in line)
    ]  # fmt: skip
