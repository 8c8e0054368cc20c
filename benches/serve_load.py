"""Load test of `klein serve` on the tiny bundle: N concurrent clients on 127.0.0.1 for a bounded
time and a bounded number of requests each. Prints throughput, latency percentiles, how many
requests the full queue turned away (429), whether every accepted request got the image
`klein generate` writes for the same options (byte for byte), and the server's resident memory at
the start and the end.

    python benches/serve_load.py --clients 8 --seconds 180 --queue 4

Not a test: figures go to benches/RESULTS.md with the command that made them.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
# The requests the clients cycle through: each one's image is made once by the CLI to compare.
VARIANTS = [
    {"prompt": "a red fox in the snow", "size": "64x64", "seed": 1},
    {"prompt": "a lighthouse at dusk", "size": "64x80", "seed": 2},
    {"prompt": "ein Haus am See", "size": "80x64", "seed": 3},
    {"prompt": "a bowl of ramen", "size": "64x64", "seed": 4, "steps": 3},
    {"prompt": "", "size": "48x64", "seed": 5},
    {"prompt": "two cats", "size": "64x64", "seed": 6, "n": 2},
]


def cli_images(klein: Path, bundle: Path, variant: dict, out_dir: Path) -> list[bytes]:
    width, height = variant["size"].split("x")
    n = variant.get("n", 1)
    out = out_dir / f"v{variant['seed']}.png"
    args = [str(klein), "generate", "--model", str(bundle), "-q", variant["prompt"], "--width", width]
    args += ["--height", height, "--seed", str(variant["seed"]), "--num-images", str(n), "-o", str(out)]
    if "steps" in variant:
        args += ["--steps", str(variant["steps"])]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    if n == 1:
        return [out.read_bytes()]
    return [(out_dir / f"v{variant['seed']}-{i}.png").read_bytes() for i in range(1, n + 1)]


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=180.0, help="stop sending after this long")
    parser.add_argument("--max-requests", type=int, default=2000, help="per client")
    parser.add_argument("--queue", type=int, default=4, help="the server's --queue")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads")
    parser.add_argument("--bundle", type=Path, default=REPO / "onnx" / "klein-tiny")
    parser.add_argument("--klein", type=Path, default=REPO / "target" / "release" / "klein")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        expected = [cli_images(args.klein, args.bundle, v, Path(tmp)) for v in VARIANTS]

    command = [str(args.klein), "serve", "--model", str(args.bundle), "--host", "127.0.0.1", "--port", "0"]
    command += ["--queue", str(args.queue)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    url = None
    while url is None:
        line = server.stderr.readline()
        if not line:
            raise SystemExit("klein serve exited")
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        url = match.group(1) if match else None
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    while httpx.get(f"{url}/readyz").status_code != 200:
        time.sleep(0.1)
    rss_start = rss_kib(server.pid)

    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"sent": 0, "ok": 0, "equal": 0, "different": 0, "429": 0, "other": 0}
    others: list[str] = []
    stop_at = time.monotonic() + args.seconds

    def client(index: int) -> None:
        with httpx.Client(timeout=120) as http:
            for i in range(args.max_requests):
                if time.monotonic() >= stop_at:
                    return
                k = (index + i) % len(VARIANTS)
                body = {**VARIANTS[k], "response_format": "b64_json"}
                start = time.monotonic()
                r = http.post(f"{url}/v1/images/generations", json=body)
                seconds = time.monotonic() - start
                with lock:
                    counts["sent"] += 1
                    if r.status_code == 429:
                        counts["429"] += 1
                    elif r.status_code == 200:
                        counts["ok"] += 1
                        latencies.append(seconds)
                        images = [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]
                        counts["equal" if images == expected[k] else "different"] += 1
                    else:
                        counts["other"] += 1
                        others.append(f"{r.status_code} {r.text[:200]}")
                if r.status_code == 429:
                    # Back off a little, less than Retry-After asks: the point is to keep the queue full.
                    time.sleep(min(float(r.headers.get("retry-after", "1")), 0.25))

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    rss_end = rss_kib(server.pid)
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=120)

    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, round(p / 100 * (len(latencies) - 1)))] if latencies else float("nan")

    report = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "queue": args.queue,
        **counts,
        "throughput_rps": round(counts["ok"] / elapsed, 2),
        "latency_p50_s": round(pct(50), 3),
        "latency_p99_s": round(pct(99), 3),
        "latency_mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "rss_start_mib": round(rss_start["VmRSS"] / 1024, 1),
        "rss_end_mib": round(rss_end["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(rss_end["VmHWM"] / 1024, 1),
        "server_exit": code,
    }
    print(json.dumps(report, indent=2))
    for line in others[:5]:
        print("unexpected answer:", line)
    ok = counts["different"] == 0 and counts["other"] == 0 and counts["equal"] == counts["ok"] and code == 0
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
