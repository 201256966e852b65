"""A fork server for the end-to-end tests, and its client: the server imports TensorFlow and mixloop
once, then runs each requested `python -m <command>` in a process forked from it, so a test does not
pay the ~4 s import.

Each command still runs as it does from a shell: its own process (pid, signals, exit status), the
stdin/stdout/stderr the test passed, its own working directory, environment and `sys.argv`, and the
same `runpy` entry `python -m` uses. Nothing of TensorFlow's runtime is started before the fork
(importing it starts no device, session or thread pool), so every command starts it afresh.

Protocol, one request per connection: the client sends a JSON object {"argv", "env", "cwd"} with its
three stdio descriptors attached (SCM_RIGHTS); the server replies with the command's pid, then with
its exit status (negative: killed by that signal), each as one 4-byte integer.
"""

import array
import atexit
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types

PRELOAD = ("numpy", "sklearn.datasets", "tensorflow", "keras", "keras_hub", "mixloop.cli",
           "mixloop.runner.trainer")
_INT = struct.Struct("!i")


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """One request and its three descriptors."""
    message, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
    descriptors = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors += struct.unpack(f"{len(data) // 4}i", data)
    return json.loads(message), descriptors


def become_command(request: dict, descriptors: list[int]) -> None:
    """Turns this forked process into `python -m <argv[0]> argv[1:]` as the request describes;
    returns only by the command's own exit (SystemExit or an uncaught exception)."""
    for target, descriptor in enumerate(descriptors):
        os.dup2(descriptor, target)
        os.close(descriptor)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra_paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd()] + [p for p in extra_paths if p not in sys.path] + sys.path[1:]
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.orig_argv = [sys.executable, "-m", *request["argv"]]
    sys.argv = ["-m"]  # What it is while `python -m` imports the command's package.
    if "mixloop" in sys.modules:  # What importing mixloop does in a fresh `python -m mixloop.*`.
        sys.modules["mixloop"].interrupts.exit_quietly_while_starting()
    sys.argv = list(request["argv"])
    sys.modules["__main__"] = types.ModuleType("__main__")  # Not this server's namespace.
    runpy._run_module_as_main(request["argv"][0])  # What `python -m` calls.


def serve_one(listener: socket.socket, connection: socket.socket) -> None:
    """In a forked helper: forks the command, reports its pid and exit status, and exits."""
    request, descriptors = receive_request(connection)
    pid = os.fork()
    if pid == 0:
        listener.close()
        connection.close()
        become_command(request, descriptors)
        sys.exit(0)
    for descriptor in descriptors:
        os.close(descriptor)
    connection.sendall(_INT.pack(pid))
    _, status = os.waitpid(pid, 0)
    connection.sendall(_INT.pack(os.waitstatus_to_exitcode(status)))
    os._exit(0)


def serve(path: str) -> None:
    """Accepts requests on the Unix socket `path` until it is killed, or its parent (the test
    process that started it) ends."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG.
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # An optional one (keras-hub): the commands that need it import it.
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            serve_one(listener, connection)
        connection.close()
        while True:  # Reap the helpers that have finished.
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


_server = None  # This test process's server: its process and socket path.


def _server_path() -> str:
    """The socket of this process's server, started on first use."""
    global _server
    if _server is None or _server[0].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="mixloop-forks-"), "socket")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)),
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"),
             os.environ.get("PYTHONPATH", "")]))
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {process.wait()}); "
                               f"run `python {__file__} /tmp/socket` to see why")
        atexit.register(process.kill)
        _server = (process, path)
    return _server[1]


class ServedProcess:
    """A command the server runs, with the parts of `subprocess.Popen` the tests use (text
    streams; stdin is empty)."""

    def __init__(self, argv: list[str], env: dict, cwd: str, stdout=None, stderr=None):
        self.args = argv
        self.returncode = None
        self.stdout = self.stderr = None
        given = [os.open(os.devnull, os.O_RDONLY)]
        for name, target, inherited in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if target == subprocess.PIPE:
                read_end, write_end = os.pipe()
                setattr(self, name, open(read_end, encoding="utf-8", errors="replace"))
                given.append(write_end)
            elif target == subprocess.DEVNULL:
                given.append(os.open(os.devnull, os.O_WRONLY))
            else:
                given.append(os.dup(inherited))
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._connection.connect(_server_path())
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
            self._connection.sendmsg(
                [request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", given))])
        finally:
            for descriptor in given:
                os.close(descriptor)
        self.pid = self._receive(timeout=None)

    def _receive(self, timeout):
        self._connection.settimeout(timeout)
        data = self._connection.recv(_INT.size, socket.MSG_WAITALL)
        if len(data) != _INT.size:
            raise RuntimeError(f"the fork server lost the command {self.args}")
        return _INT.unpack(data)[0]

    def wait(self, timeout=None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._receive(timeout)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._connection.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal_number)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None) -> tuple:
        """Reads the piped streams to their ends and waits for the exit, like Popen's."""
        streams = [stream for stream in (self.stdout, self.stderr) if stream is not None]
        texts = {}
        readers = [threading.Thread(target=lambda s=s: texts.__setitem__(s, s.read()), daemon=True)
                   for s in streams]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in streams:
            stream.close()
        return texts.get(self.stdout), texts.get(self.stderr)


if __name__ == "__main__":
    serve(sys.argv[1])
