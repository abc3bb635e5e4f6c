"""Run one untrusted program under limits, then kill everything it started. Standard library only.

Started by sandbox.py as `python -I -S jail.py SPEC.json` (a fresh single-threaded interpreter, so nothing here
runs between fork and exec of a threaded parent). SPEC names the argv, cwd, env, timeout and limits. The jail:

- becomes a child subreaper, so every process the program starts (double-forked, setsid'd) is re-parented to it;
- forks the program, which before exec: sets RLIMIT_CPU / AS / FSIZE / CORE; when running as root, drops to an
  unprivileged uid (root ignores RLIMIT_NPROC and file permissions); sets RLIMIT_NPROC so it cannot fork (or only
  a few times, for shells); and, where the kernel has Landlock, confines all writes to its cwd (plus /dev/null),
  forbids TCP and, on newer kernels, signals to processes outside the sandbox;
- waits up to the timeout, then SIGKILLs the program and every remaining descendant, reaps them, and writes a
  status JSON to SPEC["status"].
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time
import warnings  # noqa: F401 - os.execvpe imports it lazily, which fails once the uid is dropped

PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# filesystem rights (linux/landlock.h)
FS_WRITE_FILE = 1 << 1
FS_REMOVE_DIR, FS_REMOVE_FILE = 1 << 4, 1 << 5
FS_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux, too old, or disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        v = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(v, 0)


def confine_writes(root: str, abi: int) -> None:
    """Landlock: from now on this process and its children may write only beneath `root` (and to /dev/null)."""
    libc = _libc()
    write = FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE
    if abi >= 2:
        write |= FS_REFER
    if abi >= 3:
        write |= FS_TRUNCATE
    attr = _RulesetAttr(write, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path, rights in ((root, write), ("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))):
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, pfd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, fd, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                                ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(pfd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(fd)


def _user_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _child(spec: dict, abi: int) -> None:
    """In the forked child: limits, identity, confinement, exec. Never returns."""
    try:
        os.setpgid(0, 0)  # its own process group, killed as a whole at the end
        for res, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, spec["cpu_s"]),
                           (resource.RLIMIT_AS, spec["as_bytes"]), (resource.RLIMIT_FSIZE, spec["fsize_bytes"])):
            resource.setrlimit(res, (value, value))
        uid = spec.get("uid")
        if os.geteuid() == 0 and uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if sys.platform.startswith("linux"):  # counts processes per uid: what already runs + the allowance
            limit = _user_processes(os.getuid()) + spec["forks"]
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        if abi:
            confine_writes(spec["cwd"], abi)
        os.chdir(spec["cwd"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - report any failure to start, then die
        os.write(2, f"jail: cannot start {spec['argv'][0]}: {e}\n".encode())
        os._exit(127)


def _children() -> list[int]:
    pids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        if not os.path.isdir("/proc"):
            return pids
        me = os.getpid()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        pids.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def _kill_all() -> int:
    """SIGKILL and reap every process left under the jail (orphans come here: we are their subreaper)."""
    killed = 0
    for _ in range(1000):
        pids = _children()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        _reap(block=False)
        time.sleep(0.005)
    _reap(block=False)
    return killed


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    libc = _libc()
    if sys.platform.startswith("linux"):
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    abi = landlock_abi() if spec.get("landlock", True) else 0
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(spec, abi)
    status, timed_out = None, False
    deadline = t0 + spec["timeout_s"]
    while status is None:
        try:
            got, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if got == pid:
            status = st
        elif got == 0:
            if time.monotonic() >= deadline:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
            else:
                time.sleep(0.002)
    wall = time.monotonic() - t0
    try:
        os.killpg(pid, signal.SIGKILL)  # what stayed in its group (everywhere; /proc below is Linux's)
    except (ProcessLookupError, PermissionError):
        pass
    leftovers = _kill_all()  # whatever the program left running (daemons, sleepers, a fork bomb's remains)
    result = {"timed_out": timed_out, "wall_s": wall, "leftover_processes": leftovers, "landlock_abi": abi,
              "exit_code": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
              "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None}
    with open(spec["status"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
