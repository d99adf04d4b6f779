#!/usr/bin/env python3
"""Network probes run inside an agent's sandbox by the egress tests; each prints one JSON
value and exits 0 whatever happened (the test reads what it printed).

  net_probe.py http <url>           GET through $HTTP_PROXY (absolute-form HTTP)
  net_probe.py connect <host> <port> a CONNECT tunnel through $HTTP_PROXY, then GET /
  net_probe.py direct <host> <port>  a TCP connection without the proxy
  net_probe.py get <url>            GET without the proxy (a loopback forward's way)
"""

import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request


def http(url):
    # The proxy is named explicitly: NO_PROXY (loopback, for brokered base URLs) would
    # send a loopback test server direct.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": os.environ["HTTP_PROXY"]})
    )
    for name in ("NO_PROXY", "no_proxy"):
        os.environ.pop(name, None)
    try:
        r = opener.open(url, timeout=15)
        return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
    except Exception as e:  # noqa: BLE001 - the test wants to see what it was
        return [0, repr(e)]


def get(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        r = opener.open(url, timeout=15)
        return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
    except Exception as e:  # noqa: BLE001
        return [0, repr(e)]


def read_head(s):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def connect(host, port):
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    try:
        s = socket.create_connection((proxy.hostname, proxy.port), timeout=15)
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = read_head(s).decode(errors="replace")
        status = int(head.split(" ", 2)[1])
        if status != 200:
            return [status, head]
        s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        return [status, answer.decode(errors="replace").split("\r\n\r\n", 1)[-1]]
    except Exception as e:  # noqa: BLE001
        return [0, repr(e)]


def direct(host, port):
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        return "connected"
    except Exception as e:  # noqa: BLE001
        return repr(e)


def main():
    mode, *args = sys.argv[1:]
    out = {"http": http, "connect": connect, "direct": direct, "get": get}[mode](*args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
