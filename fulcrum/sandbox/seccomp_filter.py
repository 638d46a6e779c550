"""A seccomp filter for jailed code: the system calls no program in the jail needs, refused with EPERM.

It narrows the kernel's attack surface behind the namespaces (fulcrum.sandbox.jail), in the spirit of
Flatpak's filter: no ptrace or cross-process memory access, no new namespaces (clone/unshare flags,
setns), no mounts, no kernel keyrings, eBPF, perf events, userfaultfd or io_uring, no module loading,
no TIOCSTI/TIOCLINUX terminal injection, no socket families beyond Unix, IPv4, IPv6 and netlink. `clone3` answers ENOSYS, so that the C library falls back to `clone`,
whose flags the filter can see. System calls of another ABI (32-bit x86 on a 64-bit kernel) kill the
process: a filter written for one ABI says nothing about another.

Built with libseccomp through `pyseccomp` (its ctypes binding) once per process and handed to bubblewrap
as compiled BPF (`--seccomp FD`). Where libseccomp is missing, `filter_bytes()` is None and the jail runs
without it; the namespaces, not this filter, are the boundary.
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile

log = logging.getLogger("fulcrum.sandbox")

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "perf_event_open", "bpf", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "swapon",
    "swapoff", "reboot", "syslog", "quotactl", "uselib", "lookup_dcookie", "vhangup",
)  # fmt: skip
NAMESPACE_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
TERMINAL_INJECTION = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
ALLOWED_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
FAMILY_LIMIT = 64  # above AF_MAX of any kernel so far


@functools.lru_cache(maxsize=1)
def filter_bytes() -> bytes | None:
    """The compiled filter, or None where libseccomp (or pyseccomp) is not there."""
    try:
        import pyseccomp as sc

        refuse = sc.ERRNO(errno.EPERM)
        rules = sc.SyscallFilter(sc.ALLOW)
        for name in DENIED:
            try:
                rules.add_rule(refuse, name)
            except (ValueError, RuntimeError, OSError):  # a call this kernel's table does not have
                pass
        rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for flag in NAMESPACE_FLAGS:
            rules.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        for request in TERMINAL_INJECTION:
            rules.add_rule(refuse, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
        for family in range(FAMILY_LIMIT):
            if family not in ALLOWED_FAMILIES:
                rules.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
        rules.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.GE, FAMILY_LIMIT))
        with tempfile.TemporaryFile() as sink:  # libseccomp writes the program to a real descriptor
            rules.export_bpf(sink)
            sink.seek(0)
            return sink.read()
    except (ImportError, OSError, RuntimeError, ValueError, AttributeError) as err:
        log.warning("no seccomp filter for jailed code (libseccomp unavailable: %s)", err)
        return None
