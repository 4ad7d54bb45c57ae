"""Run a command as on a kernel without one of the sandbox's mechanisms:

    python tests/rl/simulated_kernel.py landlock|namespaces|seccomp -- COMMAND...

A seccomp filter (loaded here, inherited by the command and everything it starts) answers the system calls that
mechanism needs as such a kernel does: ENOSYS for Landlock's (a kernel built without it), EPERM for creating a
user namespace (one that forbids them to unprivileged users, or a container that does), EINVAL for loading a
seccomp filter (a kernel without CONFIG_SECCOMP_FILTER). The probes in `posttrain.envs.confinement` make the real
calls, so what they see is what they would see on such a machine.
"""

from __future__ import annotations

import errno
import os
import sys

import pyseccomp as sc

CLONE_NEWUSER = 0x10000000
PR_SET_SECCOMP = 22


def main() -> None:
    feature, separator, *command = sys.argv[1:]
    assert separator == "--" and command, __doc__
    rules = sc.SyscallFilter(sc.ALLOW)
    if feature == "landlock":
        for name in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
            rules.add_rule(sc.ERRNO(errno.ENOSYS), name)
    elif feature == "namespaces":
        for name in ("unshare", "clone"):
            rules.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
        rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags are in memory: libc falls back to clone
    elif feature == "seccomp":
        rules.add_rule(sc.ERRNO(errno.EINVAL), "seccomp")
        rules.add_rule(sc.ERRNO(errno.EINVAL), "prctl", sc.Arg(0, sc.EQ, PR_SET_SECCOMP))
    else:
        raise SystemExit(f"unknown feature {feature!r}: landlock, namespaces or seccomp")
    rules.load()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
