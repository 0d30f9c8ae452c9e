"""The built-in tokenizer in a process of its own: the child side of `gateway.tokenize_pool`'s helper.

    python -m gateway.tokenize_helper      (started by the pool; stdin and stdout are its pipes)

Why a process: the built-in tokenizer is Python and holds the GIL, which the gateway's event loop
shares with the pool's threads (`gateway.tokenize_pool`). The protocol is as small as the job,
one request at a time, little-endian lengths:

    request:  limit (u64), n (u64), then n bytes of the text as UTF-8 (lone surrogates passed)
    answer:   count (u64), then count ids as native unsigned 32-bit ints (`encode_upto`'s)

End of input (the gateway closed the pipe, or died) ends the process; so does anything it cannot
read. No multiprocessing: nothing of the parent's is imported here, its `__main__` least of all.
"""

from __future__ import annotations

import signal
import struct
import sys
from array import array
from typing import BinaryIO

from fleetcore.tokens import encode_upto

REQUEST = struct.Struct("<QQ")
ANSWER = struct.Struct("<Q")


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    while (head := _read_exact(stdin, REQUEST.size)) is not None:
        limit, size = REQUEST.unpack(head)
        raw = _read_exact(stdin, size)
        if raw is None:
            return
        ids = array("I", encode_upto(raw.decode("utf-8", "surrogatepass"), limit))
        stdout.write(ANSWER.pack(len(ids)))
        stdout.write(ids.tobytes())
        stdout.flush()


def main() -> int:
    # Ctrl-C in a terminal reaches the whole process group: the gateway stops, closes the pipe,
    # and this ends on its own (without a traceback of an interrupted read).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
