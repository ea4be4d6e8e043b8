"""Headless Chromium driven over its DevTools protocol (a websocket; aiohttp is the client), for the
dashboard's browser test. No extra Python package: the protocol is JSON messages."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time

import aiohttp


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """`async with Browser(exe, profile_dir) as b`: one page; `goto`, `eval`, `screenshot`."""

    def __init__(self, exe: str, profile_dir: str, size: tuple[int, int] = (1400, 1700)):
        self.exe, self.profile_dir, self.size = exe, profile_dir, size
        self.proc: subprocess.Popen | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Browser":
        os.makedirs(self.profile_dir, exist_ok=True)
        port_file = os.path.join(self.profile_dir, "DevToolsActivePort")
        self.proc = subprocess.Popen(
            [self.exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile_dir}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"chromium did not start (exit status {self.proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://127.0.0.1:{port}/json/list") as r:
            targets = await r.json(content_type=None)
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.ws.close()
            await self.http.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    async def send(self, method: str, **params):
        mid = next(self._ids)
        await self.ws.send_str(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), 60)).data)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str):
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.time() + timeout
        while True:
            try:
                v = await self.eval(expression)
            except RuntimeError:
                v = None
            if v:
                return v
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: str) -> int:
        data = base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])
        with open(path, "wb") as f:
            f.write(data)
        return len(data)
