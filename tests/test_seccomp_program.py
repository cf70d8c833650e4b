"""The sandbox's seccomp program, read instruction by instruction without a kernel.

A small classic-BPF interpreter runs the compiled program on made-up ``seccomp_data`` for
both architectures (aarch64 cannot be attacked on an x86_64 machine), and the system call
numbers are checked against libseccomp's tables where the library is installed.  The
attacks through real sandboxes are in ``test_security_seccomp.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import types
from pathlib import Path

import pytest

from riverbed.runtime import Sandbox
from riverbed.runtime import sandbox as sandbox_module
from riverbed.runtime.sandbox import probe
from riverbed.runtime.seccomp import ARCHES, REFUSED, UnknownArchitecture, program

ALLOW = "allow"
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWTIME, SIGCHLD = 0x10000000, 0x00020000, 0x80, 17
# what glibc's fork() and pthread_create() pass to clone
FORK = 0x01200000 | SIGCHLD
THREAD = 0x003D0F00


def run(prog: bytes, *, arch: int, nr: int, args: tuple[int, ...] = ()) -> str:
    """What the filter answers: ``allow``, or the errno's name."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    ops = [struct.unpack_from("=HBBI", prog, at) for at in range(0, len(prog), 8)]
    acc = pc = 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret
            if k == 0x7FFF0000:
                return ALLOW
            assert k & 0xFFFF0000 == 0x00050000, hex(k)
            return errno.errorcode[k & 0xFFFF]
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_each_refused_call_is_refused_and_ordinary_ones_are_not(machine: str) -> None:
    arch = ARCHES[machine]
    prog = program(machine)
    nr = arch.numbers
    for name in REFUSED:
        if name in nr:
            assert run(prog, arch=arch.audit, nr=nr[name]) == "EPERM", name
    assert {"iopl", "ioperm"}.isdisjoint(nr) == (machine == "aarch64")
    for ordinary in (0, 1, 3, 57, 59, 60, 63, 64, 93, 221, 231, 260, 334):  # read, write, exit, openat, …
        if ordinary not in nr.values():
            assert run(prog, arch=arch.audit, nr=ordinary) == ALLOW, ordinary


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_namespaces_are_refused_by_flag_and_clone3_falls_back(machine: str) -> None:
    arch = ARCHES[machine]
    prog = program(machine)
    clone, unshare = arch.numbers["clone"], arch.numbers["unshare"]
    assert run(prog, arch=arch.audit, nr=clone, args=(FORK,)) == ALLOW
    assert run(prog, arch=arch.audit, nr=clone, args=(THREAD,)) == ALLOW
    assert run(prog, arch=arch.audit, nr=clone, args=(FORK | CLONE_NEWUSER,)) == "EPERM"
    assert run(prog, arch=arch.audit, nr=clone, args=(FORK | CLONE_NEWNS,)) == "EPERM"
    assert run(prog, arch=arch.audit, nr=clone, args=((1 << 40) | FORK | CLONE_NEWUSER,)) == "EPERM"
    assert run(prog, arch=arch.audit, nr=unshare, args=(CLONE_NEWUSER,)) == "EPERM"
    assert run(prog, arch=arch.audit, nr=unshare, args=(CLONE_NEWTIME,)) == "EPERM"
    assert run(prog, arch=arch.audit, nr=unshare, args=(0x00000400,)) == ALLOW  # CLONE_FILES
    assert run(prog, arch=arch.audit, nr=arch.numbers["clone3"]) == "ENOSYS"


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_personality_changes_that_weaken_mitigations_are_refused(machine: str) -> None:
    arch = ARCHES[machine]
    prog = program(machine)
    nr = arch.numbers["personality"]
    for harmless in (0, 0x8, 0x20000, 0xFFFFFFFF):
        assert run(prog, arch=arch.audit, nr=nr, args=(harmless,)) == ALLOW
    for weakening in (0x0040000, 0x0400000, 0x0100000):  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, MMAP_PAGE_ZERO
        assert run(prog, arch=arch.audit, nr=nr, args=(weakening,)) == "EPERM"


def test_calls_of_another_abi_do_not_reach_the_kernel() -> None:
    x86 = ARCHES["x86_64"]
    prog = program("x86_64")
    i386_unshare = 310
    assert run(prog, arch=0x40000003, nr=i386_unshare, args=(CLONE_NEWUSER,)) == "ENOSYS"  # int 0x80
    assert run(prog, arch=x86.audit, nr=0x40000000 | x86.numbers["unshare"], args=(CLONE_NEWUSER,)) == "ENOSYS"  # x32
    assert run(prog, arch=x86.audit, nr=0x40000000) == "ENOSYS"
    arm = ARCHES["aarch64"]
    assert run(program("aarch64"), arch=0x40000028, nr=arm.numbers["unshare"], args=(CLONE_NEWUSER,)) == "ENOSYS"


def test_the_numbers_are_libseccomps() -> None:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        pytest.skip("libseccomp is not installed")
    lib = ctypes.CDLL(name)
    resolve = lib.seccomp_syscall_resolve_name_arch
    resolve.restype = ctypes.c_int
    resolve.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    for machine, arch in ARCHES.items():
        for syscall in (*REFUSED, "clone", "clone3", "unshare", "personality"):
            number = resolve(arch.audit, syscall.encode())
            if number < 0:  # no such call there
                assert syscall not in arch.numbers, (machine, syscall)
            else:
                assert arch.numbers.get(syscall) == number, (machine, syscall)


def test_an_unknown_architecture_is_refused_not_run_unfiltered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnknownArchitecture, match="riscv64"):
        program("riscv64")
    monkeypatch.setattr(os, "uname", lambda: types.SimpleNamespace(machine="riscv64"))
    sandbox_module._seccomp_program.cache_clear()
    try:
        with pytest.raises(UnknownArchitecture, match="RIVERBED_SANDBOX=process"):
            probe(Sandbox(), tmp_path / "ws")
        probe(Sandbox(mode="process"), tmp_path / "ws")  # process mode has no filter to miss
    finally:
        monkeypatch.undo()
        sandbox_module._seccomp_program.cache_clear()
