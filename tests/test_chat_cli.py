"""`mlx-kvlingo chat`, driven as a user drives it: through a pseudo-terminal."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

CLI = ("import mlx_kvlingo, typer; from mlx_kvlingo_cli.session_cmds import register; "
       "app = typer.Typer(add_completion=False); register(app); app()")


_STARTED = []  # terminals of the running test, killed after it whatever happened


@pytest.fixture(autouse=True)
def _no_chat_left_running():
    """A test that fails half way must not leave its chat generating (one left from a
    failed Ctrl-C test spun for 10 minutes and slowed the rest of the suite)."""
    yield
    while _STARTED:
        pid = _STARTED.pop().pid
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # it had exited and been reaped


class Terminal:
    """A child process on a pseudo-terminal: type lines, wait for output."""

    def __init__(self, args, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            # Started as a shell starts it: nothing blocked, SIGINT at its default (a
            # fork of pytest inherits pytest's mask and handlers, and an exec'd Python
            # installs its Ctrl-C handler only over the default).
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(sys.executable, [sys.executable, "-c", CLI, *args], env)
        _STARTED.append(self)
        self.output = ""

    def expect(self, pattern, timeout=120):
        """Read until ``pattern`` (a regex) appears after what was matched before."""
        start = len(self._consumed) if hasattr(self, "_consumed") else 0
        deadline = time.time() + timeout
        while True:
            m = re.compile(pattern).search(self.output, start)
            if m:
                self._consumed = self.output[: m.end()]
                return m
            left = deadline - time.time()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output:\n{self.output}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"exited before {pattern!r}; output:\n{self.output}")
                self.output += data.decode("utf-8", "replace").replace("\r\n", "\n")

    def type(self, text):
        os.write(self.fd, text.encode())

    def wait(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                try:
                    self.output += os.read(self.fd, 65536).decode("utf-8", "replace")
                except OSError:
                    pass
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")


def _env(cache_dir):
    return dict(os.environ, HF_HUB_OFFLINE="1", MLX_KVLINGO_CACHE=str(cache_dir),
                TERM="dumb")


REPORT = r"\((\w+): translated (\d+), prefilled (\d+), generated (\d+), first token after [\d.]+ ms\)"


def test_chat_with_a_switch_through_a_terminal(kv_cache_dir, tmp_path):
    t = Terminal(["chat", "--max-tokens", "16"], _env(kv_cache_dir))
    try:
        t.expect(r"translators: small -> large, large -> small")
        t.expect(r"\[small\] you> ")
        t.type("Return the sum of the items of a list.\n")
        t.expect(r"small> ")
        m = t.expect(REPORT)
        assert m.group(1) == "small" and int(m.group(2)) == 0 and int(m.group(4)) == 16
        first_turn = int(m.group(3)) + 16

        t.expect(r"\[small\] you> ")
        t.type("/switch large\n")
        t.expect(r"Now talking to large\.")
        t.expect(r"\[large\] you> ")
        t.type("Open the file for reading.\n")
        m = t.expect(REPORT)
        # large translates everything small wrote but the first token (computed natively).
        assert m.group(1) == "large" and int(m.group(2)) == first_turn - 1

        t.expect(r"\[large\] you> ")
        t.type("/stats\n")
        t.expect(r"turn model\s+context\s+translated\s+prefilled\s+generated")
        t.expect(r"\n\s+1 large\s+\d+\s+%d\s" % (first_turn - 1))
        t.expect(rf"large: cache holds \d+ of its \d+ tokens, {first_turn - 1} of them translated")

        t.expect(r"\[large\] you> ")
        t.type("/switch nobody\n")
        t.expect(r"No model named 'nobody'; models: small, large\.")
        t.expect(r"\[large\] you> ")
        t.type("/switch small\n")
        t.expect(r"\[small\] you> ")
        t.type("And the product?\n")
        m = t.expect(REPORT)
        assert m.group(1) == "small" and int(m.group(2)) > 0  # small reads large's turn
        t.expect(r"\[small\] you> ")
        t.type("\x04")  # Ctrl-D
        t.expect(r"Bye\.")
        assert t.wait() == 0
    finally:
        if os.environ.get("KVLINGO_CHAT_TRANSCRIPT"):
            with open(os.environ["KVLINGO_CHAT_TRANSCRIPT"], "w") as f:
                f.write(t.output)


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(kv_cache_dir):
    t = Terminal(["chat", "--max-tokens", "100000"], _env(kv_cache_dir))
    t.expect(r"\[small\] you> ")
    t.type("Return the sum of the items of a list.\n")
    t.expect(r"small> [\s\S]{40}")
    time.sleep(0.5)
    t.type("\x03")  # Ctrl-C
    t.expect(r"\[stopped\]")
    m = t.expect(REPORT)
    assert 0 < int(m.group(4)) < 100000
    t.expect(r"\[small\] you> ")
    t.type("/switch large\n")
    t.expect(r"\[large\] you> ")
    t.type("Go on.\n")
    t.expect(r"large> [\s\S]{40}")
    time.sleep(0.5)  # let the answer's stream be running when the signal lands
    t.type("\x03")
    t.expect(r"\[stopped\]")
    m = t.expect(REPORT)  # large has read what small wrote before its stop
    assert m.group(1) == "large" and int(m.group(2)) > 0
    t.expect(r"\[large\] you> ")
    time.sleep(0.5)  # the prompt is printed just before the input loop starts waiting
    t.type("\x03")  # Ctrl-C at the prompt leaves
    t.expect(r"Bye\.")
    assert t.wait() == 0


def test_chat_refuses_bad_arguments_in_one_line(toy_pair_dirs):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cases = [
        (["chat", "--model", f"only={toy_pair_dirs[0]}"], "at least two --model"),
        (["chat", "--model", "a=/nonexistent/model", "--model", f"b={toy_pair_dirs[0]}"],
         "/nonexistent/model"),
        (["chat", "--model", f"a={toy_pair_dirs[0]}", "--model", f"b={toy_pair_dirs[1]}",
          "--first", "c"], "--first 'c'"),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True,
                              text=True, env=env, timeout=300, input="")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_chat_with_named_models_without_translators_prefills(toy_pair_dirs, kv_cache_dir):
    """Explicit --model options; no translator given: the switch falls back to
    prefilling and says so."""
    src, tgt = map(str, toy_pair_dirs)
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "chat", "--model", f"s={src}", "--model", f"t={tgt}",
         "--max-tokens", "8"],
        input="Return the sum.\n/switch t\nAnd the product?\n/quit\n",
        capture_output=True, text=True, env=_env(kv_cache_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no translator (falls back to prefill): s -> t, t -> s" in proc.stdout
    assert re.search(r"\(t: translated 0, prefilled \d+, generated 8", proc.stdout)
    assert "warning: no translator s -> t: t prefilled the" in proc.stdout
