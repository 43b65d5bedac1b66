"""An incremental Server-Sent Events decoder that survives arbitrary chunk splits.

Modelled on httpx's ``LineDecoder``: bytes go in as they arrive from the socket, complete ``data:``
payloads come out.  Only the ``data`` field matters to OpenAI-compatible engines; comments and other
fields are ignored.  Multi-line data fields are joined with ``\\n`` as the SSE spec says.
"""

from __future__ import annotations


class SSEDecoder:
    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Feed raw bytes; return the data payloads of every event completed by them."""
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        n = len(buf)
        while start < n:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self._data.append(value)
            # comments (":...") and other fields (event:, id:, retry:) are ignored
        self._buf = buf[start:]
        return out

    def flush(self) -> list[bytes]:
        """End of stream: an unterminated event still counts if it has data."""
        out: list[bytes] = []
        if self._buf:
            out.extend(self.feed(b"\n"))
        if self._data:
            out.append(b"\n".join(self._data))
            self._data = []
        return out
