"""Real headless Chromium driven over the DevTools protocol (a websocket, with aiohttp).

`headless_page(tmp)` starts /usr/bin/chromium (or `$CHROMIUM`) with a private profile and
yields a `Page` whose `call(method, **params)` sends one CDP command and `evaluate(js)`
returns a JavaScript value. Every wait is bounded. A missing browser fails the test with
what to install: CI installs it (.ci/run), so no test skips for it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 20.0


def chromium_binary() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("chromium is not installed: the dashboard test renders the page in real headless Chromium. "
                    "Install it (`apt-get install -y chromium`; .ci/run does) or point $CHROMIUM at the binary.",
                    pytrace=False)
    return path


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result, skipping the events that arrive meanwhile."""
        cid = next(self._ids)
        await self.ws.send_json({"id": cid, "method": method, "params": params})
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"CDP {method}: no answer in {CALL_TIMEOUT_S:.0f} s")
            msg = await self.ws.receive_json(timeout=left)
            if msg.get("id") == cid:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return msg.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        res = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll `expression` until it is truthy; fail saying `what` did not happen."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                state = await self.evaluate("JSON.stringify({state: document.body && document.body.dataset, "
                                            "status: (document.getElementById('status')||{}).textContent})")
                raise AssertionError(f"{what} within {timeout_s:.0f} s; page: {state}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> Path:
        res = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(res["data"]))
        return path


async def _devtools_port(profile: Path, proc: asyncio.subprocess.Process, log: Path) -> int:
    # Chromium writes the port it bound (--remote-debugging-port=0) into the profile directory.
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if marker.exists():
            first = marker.read_text().splitlines()
            if first and first[0].strip().isdigit():
                return int(first[0])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"chromium did not open its DevTools port in {START_TIMEOUT_S:.0f} s: "
                       f"{log.read_text(errors='replace')[-2000:]}")


@contextlib.asynccontextmanager
async def headless_page(tmp: Path, width: int = 1400, height: int = 2200) -> AsyncIterator[Page]:
    binary = chromium_binary()
    profile = tmp / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = tmp / "chromium.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
            f"--window-size={width},{height}", "about:blank",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=err)
    try:
        port = await _devtools_port(profile, proc, log)
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # the first tab shows up in the target list shortly after the port opens
                targets = await (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chromium has no page target: {targets}")
                await asyncio.sleep(0.1)
            async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 * 2**20,
                                       timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.call("Runtime.enable")
                yield page
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10)
