"""The `ray job submit` recipe of docs/batch.md, run verbatim, as a user on a fresh machine would.

The two marked ``bash`` blocks of docs/batch.md (start a head, submit the batch job on the
default model, print the output; then ``ray stop``) run exactly as written:

- from a directory that mirrors the checkout (a symlink per top-level entry, ``.venv``
  included), so the files the recipe writes stay out of the checkout;
- with a ``PATH`` that does not contain ``.venv`` (there ``python`` is the system one, without
  keyserve: the recipe must not depend on it), a fresh ``HOME`` (no Ray token yet: the recipe
  makes one) and no ``RAY_*`` variables but ``RAY_TMPDIR`` (a temp dir of this test);
- in private user, PID, mount and network namespaces (``unshare``): the recipe's default ports
  are free whatever else runs on the machine, its ``ray stop`` sees only this cluster, and when
  the namespace's first process ends the kernel kills every process left in it, so the
  cluster is gone afterwards even if the test fails or times out.

Inside the same namespaces, after the recipe: token auth is on (the dashboard answers 401
without the token, 200 with it), and the entrypoint the README used to give (``python -m``)
fails there with ``ModuleNotFoundError``, which shows that the ``PATH`` reproduces the bug.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "batch.md"
MARK = "<!-- tested: tests/e2e/test_batch_ray_job.py runs this block verbatim -->"
VENV_BIN = Path(sys.executable).parent
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
           "--mount-proc", "--net"]

pytestmark = pytest.mark.slow  # the recipe runs the default model (SmolLM2)


def documented_blocks() -> list[str]:
    """The ``bash`` blocks of docs/batch.md that follow the test marker, in order."""
    text = DOC.read_text()
    blocks = re.findall(re.escape(MARK) + r"\n```bash\n(.*?)\n```", text, flags=re.S)
    assert len(blocks) == text.count(MARK) == 2, "docs/batch.md: expected two marked bash blocks"
    return blocks


def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True).returncode == 0


def sandbox_env(home: Path, ray_tmp: Path) -> dict[str, str]:
    from keyserve.model.paths import cache_dir

    venv = (REPO / ".venv").resolve()
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and Path(p).resolve() not in (VENV_BIN.resolve(), venv / "bin")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "VIRTUAL_ENV"}
    return {**env, "PATH": os.pathsep.join(path), "HOME": str(home), "RAY_TMPDIR": str(ray_tmp),
            "KEYSERVE_CACHE_DIR": str(cache_dir()), "OMP_NUM_THREADS": "1"}


# Runs as the namespace's first process: loopback up, the recipe, the checks, the stop block.
WRAPPER = """
{py} -c '
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))'
cd {view}
bash -eo pipefail {work}/recipe.sh > {work}/recipe.log 2>&1; echo $? > {work}/recipe.rc
{py} {work}/auth_check.py > {work}/auth.json 2>&1
RAY_AUTH_MODE=token .venv/bin/ray job submit --address http://127.0.0.1:8265 -- \\
  python -m keyserve.cluster.batch_job --help > {work}/old.log 2>&1; echo $? > {work}/old.rc
command -v python > {work}/which_python 2>&1
bash -eo pipefail {work}/stop.sh > {work}/stop.log 2>&1; echo $? > {work}/stop.rc
"""

AUTH_CHECK = """
import json, os, urllib.error, urllib.request
url = "http://127.0.0.1:8265/api/jobs/"
def status(headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code
token = open(os.path.expanduser("~/.ray/auth_token")).read().strip()
print(json.dumps({"without": status({}), "with": status({"Authorization": "Bearer " + token})}))
"""


def left_over(marker: str) -> list[str]:
    """Command lines of processes on this machine that mention ``marker`` (the temp dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(f"{proc.name}: {cmd[:200]}")
    return found


def test_the_documented_ray_job_recipe_works_verbatim(tmp_path: Path) -> None:
    if not namespaces_work():
        pytest.skip("unshare cannot make user/PID/network namespaces here (the recipe's default "
                    "ports and `ray stop` need a machine of their own)")
    recipe, stop = documented_blocks()
    work = Path(tempfile.mkdtemp(prefix="ksrj", dir="/tmp"))  # short: Ray puts unix sockets under it
    try:
        view, home, ray_tmp = work / "checkout", work / "home", work / "ray"
        for d in (view, home, ray_tmp):
            d.mkdir()
        for entry in REPO.iterdir():
            if entry.name not in ("in.jsonl", "out.jsonl"):
                (view / entry.name).symlink_to(entry)
        (work / "recipe.sh").write_text(recipe + "\n")
        (work / "stop.sh").write_text(stop + "\n")
        (work / "auth_check.py").write_text(AUTH_CHECK)
        (work / "wrapper.sh").write_text(WRAPPER.format(py=sys.executable, view=view, work=work))
        env = sandbox_env(home, ray_tmp)
        no_keyserve = subprocess.run(["python", "-c", "import keyserve"], env=env, capture_output=True)
        assert no_keyserve.returncode != 0, "the PATH without .venv still finds keyserve"

        sandbox = subprocess.Popen([*UNSHARE, "bash", str(work / "wrapper.sh")], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output = sandbox.communicate(timeout=540)[0].decode(errors="replace")
        finally:
            if sandbox.poll() is None:
                sandbox.kill()  # --kill-child: the namespace's first process dies, and all in it
                sandbox.wait()

        def read(name: str) -> str:
            p = work / name
            return p.read_text() if p.exists() else f"<no {name}>"

        log = read("recipe.log")
        assert read("recipe.rc").strip() == "0", log[-6000:] + output[-2000:]
        assert "succeeded" in log and '"succeeded": 2' in log, log[-4000:]
        records = {r["custom_id"]: r for r in map(json.loads, (view / "out.jsonl").read_text().splitlines())}
        assert set(records) == {"a", "b"}
        assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records.values())
        assert records["a"]["response"]["body"]["choices"][0]["message"]["content"].strip()
        assert records["b"]["response"]["body"]["choices"][0]["text"].strip()
        assert '"custom_id": "a"' in log and '"custom_id": "b"' in log  # the recipe's `cat out.jsonl`

        assert json.loads(read("auth.json")) == {"without": 401, "with": 200}, read("auth.json")
        old = read("old.log")
        assert read("old.rc").strip() != "0" and "ModuleNotFoundError" in old, old[-3000:]
        assert str(VENV_BIN) not in read("which_python")
        assert read("stop.rc").strip() == "0", read("stop.log")[-3000:]
    finally:
        for _ in range(60):  # the kernel reaps the namespace's processes as its first one ends
            leftovers = left_over(str(work))
            if not leftovers:
                break
            time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)
    assert not leftovers, leftovers
