"""Host memory of a save straight to S3 with one large tensor (issue 13, item 6).

::

    .venv/bin/python bench/s3_memory.py [--size-mib 2048] [--part-mib 16] [--concurrency 8]

Starts moto's S3 server on 127.0.0.1 in this process and runs each saver in a child
process (moto keeps the uploaded bytes, which must not count), measuring the child's
peak RSS during the save above its RSS just before it, the state allocated and touched
(``/proc/self/statm`` sampled every 2 ms, and ``ru_maxrss`` when the save raised the
process's peak):

* ``ckrun save``: ``Checkpointer.save`` of ``{"w": <one tensor of --size-mib>}``;
* baseline, same run: ``boto3``'s ``upload_fileobj`` (s3transfer) of the same bytes,
  read from the tensor's memory without a copy.

The bound printed is :attr:`ckrun.storage.s3_transfer.S3Writer.max_buffered_bytes`
(``max(threshold, part) + (concurrency + 1) × part``).  The ratio ckrun / baseline is
the figure to keep: both stream the same bytes with the same part size and concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid

CHILD = r"""
import io, json, resource, sys, ctypes
import torch
MiB = 1 << 20
mode, url, endpoint, size_mib, part_mib, conc = sys.argv[1:7]
size_mib, part, conc = int(size_mib), int(part_mib) * MiB, int(conc)
state = {"w": torch.ones(size_mib * MiB // 4)}
import ckrun, boto3
from ckrun.storage.s3 import S3Options, S3Storage
opts = S3Options(endpoint_url=endpoint, s3_multipart_chunk_bytes=part,
                 s3_multipart_threshold_bytes=part, s3_max_concurrency=conc,
                 s3_timeout_s=900.0)  # moto assembles a 2 GiB upload slowly
st = S3Storage.from_url(url, opts)
t = state["w"]
n = t.numel() * 4
view = memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
if mode == "ckrun":
    ck = ckrun.Checkpointer(st, rng=False, lock=False)
    ck.save(0, {"w": torch.ones(3 * MiB)})  # warm-up
else:
    from boto3.s3.transfer import TransferConfig
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    st.client.upload_fileobj(io.BytesIO(b"x" * (3 * MiB)), st.bucket, "warm", Config=cfg)
import threading, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
now = rss()
high = [now]
done = threading.Event()
def sample():
    while not done.wait(0.002):
        high[0] = max(high[0], rss())
threading.Thread(target=sample, daemon=True).start()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.monotonic()
if mode == "ckrun":
    ck.save(1, state)
else:
    class R(io.RawIOBase):
        pos = 0
        def readable(self): return True
        def readinto(self, b):
            k = min(len(b), n - self.pos)
            b[:k] = view[self.pos : self.pos + k]
            self.pos += k
            return k
    st.client.upload_fileobj(R(), st.bucket, "baseline", Config=cfg)
dt = time.monotonic() - t0
done.set()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# sampled every 2 ms; ru_maxrss is exact when the save raised the process's peak
exact = peak - now if peak > base else None
print(json.dumps({"extra_bytes": max(high[0] - now, exact or 0), "seconds": dt}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=2048)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    for k, v in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ.setdefault(k, v)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    out: dict[str, object] = {"size_mib": a.size_mib, "part_mib": a.part_mib}
    try:
        for mode in ("baseline", "ckrun"):
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            client.create_bucket(Bucket=bucket)
            args = [mode, f"s3://{bucket}/run", endpoint, str(a.size_mib)]
            args += [str(a.part_mib), str(a.concurrency)]
            r = subprocess.run(
                [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False
            )
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
            for o in client.list_objects_v2(Bucket=bucket).get("Contents", []):
                client.delete_object(Bucket=bucket, Key=o["Key"])
    finally:
        srv.stop()
    part = a.part_mib << 20
    bound = part + (a.concurrency + 1) * part  # threshold = part here
    out["bound_bytes"] = bound
    ck, base = out["ckrun"], out["baseline"]
    assert isinstance(ck, dict) and isinstance(base, dict)
    mib = 1 << 20
    print(f"one {a.size_mib} MiB tensor, {a.part_mib} MiB parts, {a.concurrency} in flight")
    print(f"  bound (threshold/part + (concurrency+1) x part): {bound / mib:8.1f} MiB")
    for name, r in (("baseline: boto3 upload_fileobj", base), ("ckrun save", ck)):
        print(f"  {name:<32} extra RSS {r['extra_bytes'] / mib:8.1f} MiB  {r['seconds']:.1f} s")
    print(
        f"  ratio ckrun / baseline extra RSS: {ck['extra_bytes'] / max(1, base['extra_bytes']):.2f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
