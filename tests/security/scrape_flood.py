"""A scrape flood: GET /metrics in a loop on several threads.

    python tests/security/scrape_flood.py URL SECONDS THREADS [TOKEN]

Prints "ready", waits for a line on stdin, then for SECONDS requests URL on THREADS
threads as fast as the daemon answers (with `Authorization: Bearer TOKEN` when given).
Prints one JSON line: the answers by HTTP status (or the error's name).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter


def main() -> None:
    url, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    headers = {"Authorization": f"Bearer {sys.argv[4]}"} if len(sys.argv) > 4 else {}
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    print("ready", flush=True)
    sys.stdin.readline()  # go
    end = time.monotonic() + seconds

    def flood() -> None:
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url, headers=headers), timeout=10
                ) as resp:
                    resp.read()
                    code = str(resp.status)
            except urllib.error.HTTPError as exc:
                code = str(exc.code)
            except OSError as exc:
                code = type(exc).__name__
            with lock:
                counts[code] += 1

    workers = [threading.Thread(target=flood) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(dict(counts)), flush=True)


if __name__ == "__main__":
    main()
