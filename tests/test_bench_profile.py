"""``bench.cpu_profile``: the benches' workers profiled by their CPU clock, written when stopped."""

from __future__ import annotations

import pstats
import signal
import subprocess
import sys
import time
from pathlib import Path

MODULE = """
import sys, time

def busy():
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass

def idle(seconds):
    time.sleep(seconds)

busy()
print("busy done", flush=True)
idle(float(sys.argv[1]))
"""


def _run(tmp_path: Path, seconds: str) -> subprocess.Popen[str]:
    (tmp_path / "spin_then_sleep.py").write_text(MODULE)
    return subprocess.Popen(
        [sys.executable, "-m", "bench.cpu_profile", str(tmp_path / "out.prof"), "-m", "spin_then_sleep", seconds],
        env={"PYTHONPATH": f"{tmp_path}:{Path.cwd()}", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        text=True,
    )


def _own_time(stats: pstats.Stats, name: str) -> float:
    found = [row for key, row in stats.stats.items() if key[2] == name]  # type: ignore[attr-defined]
    assert found, name
    return float(found[0][3])  # cumulative


def test_a_wait_counts_nothing_and_spent_cpu_counts(tmp_path: Path) -> None:
    with _run(tmp_path, "0.6") as proc:
        assert proc.wait(30) == 0
    stats = pstats.Stats(str(tmp_path / "out.prof"))
    assert _own_time(stats, "busy") >= 0.15
    assert _own_time(stats, "idle") < 0.1  # the wall clock would give it 0.6 s


def test_a_process_stopped_with_sigterm_still_writes_its_profile(tmp_path: Path) -> None:
    with _run(tmp_path, "60") as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "busy done"
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    stats = pstats.Stats(str(tmp_path / "out.prof"))
    assert _own_time(stats, "busy") >= 0.15


def test_the_modules_own_exit_status_is_the_processs(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text("import sys\nsys.exit(3)\n")
    done = subprocess.run(
        [sys.executable, "-m", "bench.cpu_profile", str(tmp_path / "out.prof"), "-m", "fails"],
        env={"PYTHONPATH": f"{tmp_path}:{Path.cwd()}", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 3
    assert (tmp_path / "out.prof").exists()


def test_a_callgrind_dump_counts_its_totals_not_its_summary(tmp_path: Path) -> None:
    """A worker's second dump of ``bench agents --context 20,2000`` under callgrind: its summary
    was the dump's totals less the first dump's (1,276,939,117 - 972,875,474), so the 2,000-event
    round had read as a third of the 20-event one's instructions a step."""
    from bench.common import dump_instructions  # noqa: PLC0415  (the bench's imports are heavy)

    dump = tmp_path / "bench-agent-1.cg.2"
    dump.write_text(
        "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npart: 2\ndesc: Trigger: dump\n"
        "positions: line\nevents: Ir\nsummary: 304063643\n\nfl=(1) ceval.c\nfn=(1) eval\n0 1276939117\n\n"
        "totals: 1276939117\n"
    )
    assert dump_instructions(dump) == 1_276_939_117
    first = tmp_path / "bench-agent-1.cg.1"
    first.write_text("version: 1\nevents: Ir\nsummary: 972875474\n\nfn=(1) eval\n0 972875474\n")
    assert dump_instructions(first) == 972_875_474  # (a dump without its totals line: the summary)
