"""A TCP proxy in front of a real Redis that drops a client's connection once, when the client sends a command
whose bytes hold a given marker (the command is never forwarded): a lost connection at a chosen point, without
mocking Redis (no tests here)."""

from __future__ import annotations

import socket
import threading


class CuttingProxy:
    """Forwards 127.0.0.1:``port`` to Redis at ``target``; once ``arm(marker)`` was called, the first client chunk
    holding ``marker`` closes that connection instead of being forwarded (then it disarms)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _cut(self, chunk: bytes) -> bool:
        with self._lock:
            if self._marker is None or self._marker not in chunk:
                return False
            self._marker = None
            self.cuts += 1
            return True

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if from_client and self._cut(chunk):
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
