"""The seccomp filter of a namespaces sandbox: system calls an agent never needs, refused.

The namespaces already keep a sandbox away from the host; this filter narrows the kernel a
sandboxed process can talk to.  Without it a command could ``unshare -Ur`` into a nested user
namespace, be uid 0 with every capability there, and mount filesystems, load BPF programs or
open io_uring rings: kernel code that a prompt-injected model has no business reaching, and
where most local privilege escalations of recent years started.

What is refused, and why (:data:`REFUSED` holds the same list as data):

- **new namespaces**: ``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag (the nested
  user namespace above, and the others, which need it), and ``setns``.  ``clone3`` passes
  its flags in memory, where a filter cannot read them, so it answers ``ENOSYS``, and glibc
  falls back to ``clone`` (whose flags are checked); a plain fork or thread still works.
- **mounts**: ``mount``, ``umount2``, ``pivot_root`` and the new mount API (``open_tree``,
  ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``).
- **kernel keyrings**: ``keyctl``, ``add_key``, ``request_key``: keyrings are not
  namespaced, so a session could read or fill what other processes of its uid keep there.
- **BPF, perf, userfaultfd, io_uring**: ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring_setup``/``enter``/``register``: large attack surfaces of the kernel, often the
  first step of an exploit (userfaultfd to win races; io_uring's operations bypass this
  filter altogether).  Programs that use io_uring fall back to plain system calls.
- **other processes' memory**: ``ptrace``, ``process_vm_readv``/``writev``,
  ``pidfd_getfd``: a debugger is not an agent's tool, and a tracer rewrites another
  process's system calls and memory (on kernels before 4.8, past a seccomp filter too).
- **the machine's own controls**, refused already for want of capabilities and refused here
  as well, in case one ever leaks in: ``kexec_load``, ``kexec_file_load``, ``init_module``,
  ``finit_module``, ``delete_module``, ``reboot``, ``swapon``, ``swapoff``, ``acct``,
  ``quotactl``, ``quotactl_fd``, ``syslog`` (the kernel log shows kernel addresses),
  ``iopl`` and ``ioperm`` (x86_64 only), and ``open_by_handle_at`` with
  ``name_to_handle_at`` (opening files by handle, past every mount: the "shocker" escape).
- **what Docker's default profile refuses too**: ``kcmp`` (compares two processes' kernel
  objects: a probe of kernel addresses), ``modify_ldt`` (x86_64 only: a process's own segment
  table, old exploit ground), ``move_pages`` (moves another process's pages between NUMA nodes
  and tells where its memory lies) and ``memfd_secret`` (memory the kernel hides from itself,
  which a session has no use for).
- **personality changes** other than the harmless ones (``PER_LINUX``, ``PER_LINUX32``,
  ``UNAME26``, the query ``0xffffffff``): ``ADDR_NO_RANDOMIZE`` and ``READ_IMPLIES_EXEC``
  switch off exploit mitigations.

Each of these answers ``EPERM``, so a program sees an ordinary refusal.  The filter also
checks the architecture the call was made in: an x86_64 process that makes i386 calls
(``int 0x80``) or x32 calls (numbers with bit 30 set) would reach other numbers than the
ones listed, so every call of a foreign ABI answers ``ENOSYS``.  x86_64 and aarch64 are
known; on any other machine :func:`program` raises :class:`UnknownArchitecture`, and a
worker refuses to start in ``namespaces`` mode rather than run sandboxes unfiltered.

Why the program is assembled here, not by libseccomp: bubblewrap wants the compiled
classic-BPF program (``--seccomp FD``), and libseccomp's Python bindings are not a
well-kept PyPI package (``pyseccomp`` is a 2021 ctypes shim that still needs the C library;
Debian's ``python3-seccomp`` is the apt step riverbed no longer asks for).  The filter is a
few dozen instructions, readable in full below: the architecture, then a jump per system
call number, then the flag checks.  The numbers are checked in the tests against
libseccomp's own tables where the library is installed, and the filter by attacking it.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import struct

from riverbed.errors import ConfigError

__all__ = ["ARCHES", "REFUSED", "Arch", "UnknownArchitecture", "program"]


class UnknownArchitecture(ConfigError):
    """No seccomp filter is known for this machine's architecture."""


REFUSED: tuple[str, ...] = (
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "syslog",
    "iopl",
    "ioperm",
    "open_by_handle_at",
    "name_to_handle_at",
    "kcmp",
    "modify_ldt",
    "move_pages",
    "memfd_secret",
)
"""System calls refused outright (``EPERM``), on the architectures that have them."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """What the filter needs to know of one architecture."""

    audit: int
    """``AUDIT_ARCH_*``: what the kernel puts in ``seccomp_data.arch``"""
    numbers: dict[str, int]
    x32: bool = False
    """whether x32 calls (``nr | 0x40000000``) share the architecture's audit value"""


_COMMON_NEW = {  # numbered alike on every architecture since Linux 5.1
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "memfd_secret": 447,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
}

ARCHES: dict[str, Arch] = {
    "x86_64": Arch(
        audit=0xC000003E,
        x32=True,
        numbers={
            "clone": 56,
            "ptrace": 101,
            "syslog": 103,
            "personality": 135,
            "pivot_root": 155,
            "acct": 163,
            "mount": 165,
            "umount2": 166,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "modify_ldt": 154,
            "iopl": 172,
            "ioperm": 173,
            "init_module": 175,
            "delete_module": 176,
            "quotactl": 179,
            "kexec_load": 246,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "move_pages": 279,
            "perf_event_open": 298,
            "name_to_handle_at": 303,
            "open_by_handle_at": 304,
            "setns": 308,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "kcmp": 312,
            "finit_module": 313,
            "kexec_file_load": 320,
            "bpf": 321,
            "userfaultfd": 323,
            **_COMMON_NEW,
        },
    ),
    "aarch64": Arch(
        audit=0xC00000B7,
        numbers={
            "umount2": 39,
            "mount": 40,
            "pivot_root": 41,
            "quotactl": 60,
            "acct": 89,
            "personality": 92,
            "unshare": 97,
            "kexec_load": 104,
            "init_module": 105,
            "delete_module": 106,
            "syslog": 116,
            "ptrace": 117,
            "reboot": 142,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "swapon": 224,
            "swapoff": 225,
            "move_pages": 239,
            "perf_event_open": 241,
            "name_to_handle_at": 264,
            "open_by_handle_at": 265,
            "setns": 268,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "kcmp": 272,
            "finit_module": 273,
            "bpf": 280,
            "userfaultfd": 282,
            "kexec_file_load": 294,
            **_COMMON_NEW,
        },
    ),
}

# clone(2) and unshare(2) flags that make a namespace; CLONE_NEWTIME shares its bit with
# clone's exit signal, so only unshare is checked for it.
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_CLONE_NEWTIME = 0x00000080
#: personality(2) values left alone: PER_LINUX, PER_LINUX32, UNAME26 (with and without
#: PER_LINUX32), and 0xffffffff, which only asks for the current one.
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
_X32_BIT = 0x40000000

# classic BPF, as <linux/filter.h> and <linux/seccomp.h> define it
_LD_ABS_W = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ, _JGE, _JSET = 0x05 | 0x10, 0x05 | 0x30, 0x05 | 0x40  # BPF_JMP | BPF_J* | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
# offsets in struct seccomp_data: int nr; __u32 arch; __u64 ip; __u64 args[6] (the low word
# of args[0] comes first on these little-endian machines)
_NR, _ARCH, _ARG0 = 0, 4, 16


@dataclasses.dataclass(frozen=True)
class _Op:
    code: int
    k: int = 0
    true: str | None = None
    """label jumped to when a test holds (None: the next instruction)"""
    false: str | None = None


def _assemble(ops: list[_Op | str]) -> bytes:
    """``struct sock_filter`` entries for ``ops``; a string in the list labels the next op."""
    labels: dict[str, int] = {}
    code: list[_Op] = []
    for op in ops:
        if isinstance(op, str):
            labels[op] = len(code)
        else:
            code.append(op)

    def offset(at: int, label: str | None) -> int:
        if label is None:
            return 0
        jump = labels[label] - at - 1
        if not 0 <= jump <= 255:
            raise ValueError(f"a jump to {label} does not fit the instruction ({jump})")
        return jump

    return b"".join(
        struct.pack("=HBBI", op.code, offset(at, op.true), offset(at, op.false), op.k) for at, op in enumerate(code)
    )


def program(machine: str | None = None) -> bytes:
    """The compiled filter for ``machine`` (``os.uname().machine`` by default), ready for
    bubblewrap's ``--seccomp``; :class:`UnknownArchitecture` for a machine it does not know."""
    machine = machine or os.uname().machine
    arch = ARCHES.get(machine)
    if arch is None:
        raise UnknownArchitecture(
            f"riverbed has no seccomp filter for this machine's architecture ({machine}; it knows "
            f"{' and '.join(ARCHES)}), and does not run namespaces sandboxes unfiltered: set "
            "RIVERBED_SANDBOX=process to run commands without isolation"
        )
    nr = arch.numbers
    ops: list[_Op | str] = [
        _Op(_LD_ABS_W, _ARCH),
        _Op(_JEQ, arch.audit, false="enosys"),
        _Op(_LD_ABS_W, _NR),
    ]
    if arch.x32:
        ops.append(_Op(_JGE, _X32_BIT, true="enosys"))
    ops += [_Op(_JEQ, nr[name], true="refuse") for name in REFUSED if name in nr]
    ops += [
        _Op(_JEQ, nr["clone"], true="clone"),
        _Op(_JEQ, nr["unshare"], true="unshare"),
        _Op(_JEQ, nr["clone3"], true="enosys"),
        _Op(_JEQ, nr["personality"], true="personality"),
        _Op(_RET, _ALLOW),
        "clone",
        _Op(_LD_ABS_W, _ARG0),
        _Op(_JSET, _CLONE_NEW, true="refuse", false="allow"),
        "unshare",
        _Op(_LD_ABS_W, _ARG0),
        _Op(_JSET, _CLONE_NEW | _CLONE_NEWTIME, true="refuse", false="allow"),
        "personality",
        _Op(_LD_ABS_W, _ARG0),
        *(_Op(_JEQ, value, true="allow") for value in _PERSONALITIES),
        "refuse",
        _Op(_RET, _ERRNO | errno.EPERM),
        "allow",
        _Op(_RET, _ALLOW),
        "enosys",
        _Op(_RET, _ERRNO | errno.ENOSYS),
    ]
    return _assemble(ops)
