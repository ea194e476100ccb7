"""A hostile media server on loopback: it declares a large body and sends one byte every `interval_s`, and counts
the connections still open (a fetch that outlives its request shows up here)."""

from __future__ import annotations

import select
import socket
import threading
import time
from contextlib import contextmanager


class DripServer:
    def __init__(self, interval_s: float = 1.0, declared: int = 100 << 20, headers_too: bool = False,
                 version: str = "HTTP/1.1"):
        self.interval_s, self.declared, self.headers_too, self.version = interval_s, declared, headers_too, version
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self.open = 0
        self.accepted = 0
        self._stop = threading.Event()

    def _drip(self, conn: socket.socket) -> None:
        with self._lock:
            self.open += 1
            self.accepted += 1
        try:
            conn.settimeout(5)
            conn.recv(65536)  # the request
            head = f"{self.version} 200 OK\r\nContent-Type: image/png\r\nContent-Length: {self.declared}\r\n\r\n".encode()
            if not self.headers_too:
                conn.sendall(head)
                head = b""
            sent = 0
            while sent < len(head) + self.declared and not self._stop.is_set():
                readable, _, _ = select.select([conn], [], [], self.interval_s)
                if readable and not conn.recv(1):
                    return  # the client closed its end: the fetch stopped
                conn.sendall(head[sent:sent + 1] or b"\x89")
                sent += 1
        except OSError:  # the client closed its end: the fetch stopped
            pass
        finally:
            conn.close()
            with self._lock:
                self.open -= 1

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def wait_closed(self, within_s: float) -> bool:
        """Whether every connection was closed by the client within `within_s` seconds."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if self.open == 0:
                return True
            time.sleep(0.05)
        return self.open == 0

    @contextmanager
    def running(self):
        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self.listener.close()
