"""A small TCP probe for hosts of their own (tests/test_hosts.py), standard library only.

    netprobe.py serve HOST PORT     echo each byte b"e"; answer b"b" + 8 bytes N with N bytes
    netprobe.py client HOST PORT    one connection, driven by lines on stdin, one JSON line out:
        probe T      send b"e" and wait up to T s for it back: {"result": "ok"|"timeout"|"reset"}
        bulk N T     ask for N bytes, wait up to T s for all: {"result": ..., "seconds": ...}
    netprobe.py names NAME...       {"hostname", "fqdn", "resolved": {NAME: address}}
"""

import json
import socket
import struct
import sys
import threading
import time


def serve(host: str, port: int) -> None:
    server = socket.create_server((host, port))
    print(json.dumps({"listening": True}), flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def answer(conn: socket.socket) -> None:
    with conn:
        while True:
            kind = conn.recv(1)
            if not kind:
                return
            if kind == b"e":
                conn.sendall(b"e")
            elif kind == b"b":
                (n,) = struct.unpack("!Q", receive(conn, 8))
                conn.sendall(bytes(n))


def receive(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return data


def client(host: str, port: int) -> None:
    conn = socket.create_connection((host, port), timeout=5)
    print(json.dumps({"connected": True}), flush=True)
    for line in sys.stdin:
        word, *args = line.split()
        start = time.monotonic()
        try:
            if word == "probe":
                conn.settimeout(float(args[0]))
                conn.sendall(b"e")
                receive(conn, 1)
            else:
                n = int(args[0])
                conn.settimeout(float(args[1]))
                conn.sendall(b"b" + struct.pack("!Q", n))
                receive(conn, n)
            result = "ok"
        except TimeoutError:
            result = "timeout"
        except (ConnectionResetError, BrokenPipeError):
            result = "reset"
        print(json.dumps({"result": result, "seconds": time.monotonic() - start}), flush=True)


def names(wanted: list[str]) -> None:
    print(json.dumps({"hostname": socket.gethostname(), "fqdn": socket.getfqdn(),
                      "resolved": {n: socket.gethostbyname(n) for n in wanted}}))


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "serve":
        serve(rest[0], int(rest[1]))
    elif mode == "client":
        client(rest[0], int(rest[1]))
    else:
        names(rest)
