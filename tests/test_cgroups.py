"""Which cgroups a worker finds, and what it writes to a v2 session cgroup, without a kernel.

The hosts these tests run on mount the cgroup v1 controllers (and an empty v2 hierarchy), so
the v2 code cannot be run against the kernel here: its files are written into a directory that
stands for a delegated v2 subtree, and checked one by one.  The real sandboxes are in
``test_security_cgroups.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from riverbed.runtime.cgroups import Bounds, Cgroups, CgroupsUnusable, Hierarchy, detect, find
from riverbed.settings import Settings
from riverbed.workers.runtime_role import checked_cgroups

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / {root}/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / {root}/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_SELF = """\
8:pids:/
6:freezer:/
4:memory:/process_api/abc
2:cpuacct:/
1:cpu:/
0::/
"""
V2 = "30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_a_hybrid_host_with_an_empty_v2_hierarchy_uses_the_v1_controllers(tmp_path: Path) -> None:
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("hugetlb\n")
    found = find(HYBRID.format(root=tmp_path), HYBRID_SELF)
    assert found == Hierarchy(
        1,
        {
            "cpu": tmp_path / "cpu",
            "memory": tmp_path / "memory" / "process_api" / "abc",  # below the worker's own cgroup
            "pids": tmp_path / "pids",
            "freezer": tmp_path / "freezer",
        },
    )


def test_a_delegated_v2_subtree_is_preferred_and_no_cgroups_is_one_sentence(tmp_path: Path) -> None:
    service = tmp_path / "system.slice" / "riverbed.service"
    service.mkdir(parents=True)
    (service / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert find(V2.format(root=tmp_path), "0::/system.slice/riverbed.service\n") == Hierarchy(2, {"unified": service})
    (service / "cgroup.controllers").write_text("cpu io\n")  # not delegated: no v1 to fall back to
    said = find(V2.format(root=tmp_path), "0::/system.slice/riverbed.service\n")
    assert said == (
        "no cgroup v2 subtree with the cpu, memory and pids controllers is delegated to this worker, "
        "and the cgroup v1 controllers cpu, memory, pids, freezer are not mounted"
    )
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text("")
    (proc / "cgroup").write_text("0::/\n")
    with pytest.raises(CgroupsUnusable, match=r"^no cgroup v2 subtree"):
        detect(Bounds(), proc_self=proc)
    # a worker on such a host says so once at start, and runs its sandboxes with their rlimits
    with capture_logs() as logs:
        assert checked_cgroups(Settings.from_env({}), proc_self=proc) is None
    assert [(e["event"], e["log_level"]) for e in logs] == [("sandbox.no_cgroups", "warning")]
    assert logs[0]["detail"].endswith("each sandbox process keeps its rlimits")


def test_a_v2_session_cgroup_is_bounded_joined_told_and_killed(tmp_path: Path) -> None:
    base = tmp_path / "riverbed.service"
    base.mkdir()
    (base / "cgroup.subtree_control").write_text("")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    cgroups = Cgroups(Hierarchy(2, {"unified": base}), Bounds(cpu=1.5, memory=512 << 20, pids=64), tag="riverbed-1-2-3")
    # the controllers enabled for the sessions (the kernel's refusal while the worker's cgroup
    # holds processes, and the worker's move into a leaf then, need a kernel: not run here)
    cgroups.prepare()
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    (base / "cgroup.subtree_control").write_text("cpu memory pids\n")  # as the kernel shows them
    cgroups.prepare()  # already enabled: nothing is written
    assert (base / "cgroup.subtree_control").read_text() == "cpu memory pids\n"

    group = cgroups.session()
    assert group.name == "riverbed-1-2-3-1"
    assert cgroups.session().name == "riverbed-1-2-3-2"  # unique per opening
    where = base / group.name
    where.mkdir()  # (the kernel makes a cgroup's files with it; memory.swap.max only with swap accounting)
    (where / "memory.swap.max").write_text("max\n")
    group.create()
    assert {
        f: (where / f).read_text() for f in ("cpu.max", "cpu.weight", "memory.max", "memory.swap.max", "pids.max")
    } == {
        "cpu.max": "150000 100000",
        "cpu.weight": "100",
        "memory.max": str(512 << 20),
        "memory.swap.max": "0",
        "pids.max": "64",
    }
    argv = group.join_argv(["bash", "-i"])
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[argv.index("--") - 1 :] == [str(where / "cgroup.procs"), "--", "bash", "-i"]

    assert group.news() is None
    (where / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    (where / "pids.events").write_text("max 12\n")
    assert group.news() == (
        "[the session's memory limit (512 MiB for all its processes together) was reached: "
        "the kernel killed 1 of its processes]\n"
        "[the session's process limit (64 processes and threads) was reached: 12 fork(s) were refused]"
    )
    assert group.news() is None  # told once

    (where / "cgroup.kill").write_text("")
    (where / "cgroup.procs").write_text("")
    group.close()
    assert (where / "cgroup.kill").read_text() == "1"
