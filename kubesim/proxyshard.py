"""A kube-proxy shard: serves the Services kubesim's ProxyController sends on standard input (network.Shard).

One JSON line per Service: {"owner": [namespace, name], "frontends": [[address, port, protocol, [namespace,
service, port name], [[backend address, port], ...]], ...]}; an empty list of frontends closes the Service's
listeners. The shard exits when its input closes, so it never outlives kubesim.
"""

from __future__ import annotations

import json
import logging
import sys

from .network import Proxy, Route


def main(argv: list[str]) -> int:
    index = argv[0] if argv else "?"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s kubesim proxy shard {index}: %(message)s")
    proxy = Proxy(None)
    proxy.start()
    try:
        for line in sys.stdin:
            try:
                message = json.loads(line)
                owner = (str(message["owner"][0]), str(message["owner"][1]))
                table = {(str(address), int(port), str(protocol)): (Route(*map(str, route)),
                                                                     [(str(ip), int(p)) for ip, p in found])
                         for address, port, protocol, route, found in message["frontends"]}
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                logging.error("ignored a malformed line from kubesim: %s", exc)
                continue
            proxy.set_table(owner, table)
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
