"""``kill -9`` a real batch job (a subprocess, stories260K) at random points, rerun it to the
end: exactly one final record per input line, and the answers of an uninterrupted run (greedy).

The first kill lands at a random moment of start-up (before any output), the next ones each
after a random number of further records; the seed is in every failure message.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from keyserve.cluster.batch_io import read_input
from keyserve.cluster.batch_job import main as batch_main

N = 80  # enough lines that a kill lands mid-run
KILLS = 4


def build_input(path: Path) -> None:
    rng = random.Random(0)
    lines = []
    for i in range(N):
        body = {"prompt": f"Once upon a time {i}", "max_tokens": rng.randint(8, 32), "temperature": 0}
        lines.append({"custom_id": f"k{i:03d}", "method": "POST", "url": "/v1/completions", "body": body})
    lines[30] = {**lines[30], "body": {"prompt": "x", "top_p": 3}}  # permanent: 400
    lines.insert(50, {**lines[10], "body": {"prompt": "a repeat of k010"}})  # a duplicate id
    text = [json.dumps(x) for x in lines]
    text.insert(70, "{torn input")  # reported as line-71
    path.write_text("\n".join(text) + "\n")


def flags(src: Path, out: Path, model: str) -> list[str]:
    return ["--input", str(src), "--output", str(out), "--model", model, "--num-blocks", "256",
            "--max-num-seqs", "4", "--concurrency", "4", "--no-progress"]


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def final_records(out: Path, src: Path, context: str = "") -> dict[str, dict]:
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    counts = Counter(r["custom_id"] for r in recs)
    keys = [line.key for line in read_input(src)]
    assert sorted(counts) == sorted(keys), (context, set(counts) ^ set(keys))
    assert all(n == 1 for n in counts.values()), (context, counts.most_common(3))
    return {r["custom_id"]: r for r in recs}


def answer(record: dict) -> object:
    """What the line answered (not the random ids)."""
    if record["error"] is not None:
        return ("error", record["error"]["code"])
    body = record["response"]["body"]
    if record["response"]["status_code"] != 200:
        return (record["response"]["status_code"], body["error"]["param"])
    return [(c["text"], c["finish_reason"]) for c in body["choices"]], body["usage"]["completion_tokens"]


def test_kill_9_at_random_points_then_rerun_gives_one_record_per_line(stories_path: str,
                                                                       tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    src = tmp_path / "in.jsonl"
    build_input(src)
    ref_out, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert batch_main(flags(src, ref_out, stories_path)) == 0
    reference = {cid: answer(r) for cid, r in final_records(ref_out, src).items()}
    assert sum(a[0] != "error" and not isinstance(a[0], int) for a in reference.values()) == N - 1

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "keyserve.cluster.batch_job", *flags(src, out, stories_path)]
    kills = []
    for k in range(KILLS):
        before = count_lines(out)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            if k == 0:  # somewhere in start-up (imports, model load): nothing written yet
                time.sleep(rng.uniform(0.0, 3.0))
            else:  # after a random number of new records (a kill may land mid-write)
                target = before + rng.randint(1, max(1, (N - before) // (KILLS - k + 1)))
                while count_lines(out) < target and proc.poll() is None:
                    time.sleep(0.002)
            alive = proc.poll() is None
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace")
        assert alive, f"seed {seed}: round {k}: the job ended before the kill: {err[-2000:]}"
        kills.append((before, count_lines(out)))
    assert count_lines(out) < N + 2, f"seed {seed}: every line was done before the last kill: {kills}"
    assert any(after > before for before, after in kills), f"seed {seed}: no kill landed mid-run: {kills}"

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-3000:]}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["unfinished"] == 0 and summary["total"] == N + 2
    got = {cid: answer(r) for cid, r in final_records(out, src, f"seed {seed}: kills at {kills}").items()}
    assert got == reference, f"seed {seed}: kills at {kills}: " + str(
        {cid: (got[cid], reference[cid]) for cid in got if got[cid] != reference[cid]})
