"""An incremental Server-Sent Events decoder that survives arbitrary chunk splits.

Modelled on httpx's ``LineDecoder``: bytes go in as they arrive from the socket, complete ``data:``
payloads come out.  Lines end at LF, CRLF or a bare CR (a CRLF split across two reads included), and
a UTF-8 BOM opening the stream is dropped, as the SSE specification says.  Only the ``data`` field
matters to OpenAI-compatible engines; comments and the ``id``/``retry`` fields are ignored.
Multi-line data fields are joined with ``\\n`` as the SSE spec says.  A failure an engine sends
outside ``data`` comes out as an error payload (``{"error": ...}``): an ``event: error`` event's data
(where it is not such an object itself), and the ``error:`` field older llama.cpp servers send.
"""

from __future__ import annotations

_BOM = b"\xef\xbb\xbf"


def _as_error(data: bytes) -> bytes:
    """An error event's data as the error payload the engine client reads."""
    stripped = data.lstrip()
    if stripped.startswith(b"{") and b'"error"' in stripped[:64]:
        return data  # already {"error": ...}
    return b'{"error":' + (data if data.strip() else b"null") + b"}"


class SSEDecoder:
    __slots__ = ("_buf", "_data", "_started", "_cr", "_error")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._started = False
        self._cr = False  # the last read ended with a CR: an LF opening the next one ends no line
        self._error = False  # the event being read is an error (``event: error``, an ``error:`` field)

    def _dispatch(self) -> bytes:
        data = b"\n".join(self._data)
        self._data = []
        if self._error:
            self._error = False
            return _as_error(data)
        return data

    def feed(self, chunk: bytes) -> list[bytes]:
        """Feed raw bytes; return the data payloads of every event completed by them."""
        if not self._started and chunk:
            self._started = True
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM):]
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        if b"\r" in chunk:
            self._cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        else:
            self._cr = False
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
            if not line:
                if self._data:
                    out.append(self._dispatch())
                self._error = False
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self._data.append(value)
            elif line.startswith(b"event:"):
                self._error = line[6:].strip() == b"error"
            elif line.startswith(b"error:"):  # (older llama.cpp: `error: {json}`)
                value = line[6:].strip()
                self._data.append(value)
                self._error = True
            # comments (":...") and the other fields (id:, retry:) are ignored
        self._buf = buf[start:]
        return out

    def flush(self) -> list[bytes]:
        """End of stream: an unterminated event still counts if it has data."""
        out: list[bytes] = []
        if self._buf:
            out.extend(self.feed(b"\n"))
        if self._data:
            out.append(self._dispatch())
        return out
