"""A forked child never runs its parent's signal handlers (collectives/forking.py): a SIGTERM that reaches a shard or
a rank in its first instant, before its entry function has installed its own handlers, is held and handled by the
child's handler -- it does not raise KeyboardInterrupt inside the child's copy of the parent's stack (where the child
ran the parent's clean-up code and then the rest of the parent's program: in CI, a second pytest worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

# what `pslab` does (SIGTERM -> KeyboardInterrupt), then SIGTERM to every forked child at the instant it exists
SCRIPT = textwrap.dedent("""
    import ctypes, functools, os, signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def work(group):
        return group.rank

    {imports}
    signal.signal(signal.SIGTERM, interrupt)
    parent = os.getpid()
    # (after the imports: other after-fork hooks, e.g. threading's, run Python code; ours come last)
    # in each forked child: SIGTERM raised while blocked, then unblocked by libc's pthread_sigmask called straight
    # from C (no Python frame of the hook for the handler to run in, and no signal check of Python's own
    # signal.pthread_sigmask): the handler runs in whatever Python code the child executes next -- right after
    # os.fork() returns, in multiprocessing's Popen, the instant CI met -- unless the child's mask (forking.start's)
    # holds SIGTERM still, in which case the hook leaves it held
    unblock = (ctypes.c_ulong * 16)()          # a sigset_t: bit signum - 1
    def hold():
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
        unblock[0] = 0 if signal.SIGTERM in before else 1 << (signal.SIGTERM - 1)
        os.kill(os.getpid(), signal.SIGTERM)
    os.register_at_fork(after_in_child=hold)
    os.register_at_fork(after_in_child=functools.partial(ctypes.CDLL(None).pthread_sigmask, signal.SIG_UNBLOCK,
                                                         unblock, None))
    try:
        {call}
    except BaseException as e:
        if os.getpid() != parent:
            print("ESCAPED into the parent's code:", type(e).__name__, flush=True)
            os._exit(3)
        print("parent:", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
    else:
        print("parent: no error", flush=True)
""")

CALLS = {
    "ps-shard": ("from pslab.ps import start_servers",
                 "start_servers(1, 1, start_method='fork', idle_timeout=30, start_timeout=60).stop()"),
    "launcher-rank": ("from pslab import collectives",
                      "collectives.launch(work, 2, start_method='fork', timeout=60)"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_sigterm_in_a_forked_childs_first_instant_is_the_childs_to_handle(what, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    script = SCRIPT.format(imports=CALLS[what][0], call=CALLS[what][1])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env)
    text = out.stdout + out.stderr
    assert "ESCAPED" not in text, text
    # the child ended by its own handler: the start failed, in the parent, with pslab's error for a child that died
    assert out.returncode == 0 and "parent:" in out.stdout and "no error" not in out.stdout, text
    assert "KeyboardInterrupt" not in out.stdout, text


def test_start_restores_the_signal_mask():
    from pslab.collectives import forking

    class Failing:
        def start(self) -> None:
            raise OSError("Resource temporarily unavailable (fork)")

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with pytest.raises(OSError):
        forking.start(Failing(), "fork")
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_a_handler_that_runs_as_the_signals_are_blocked_leaves_the_mask_as_it_was(monkeypatch):
    """CPython's pthread_sigmask changes the mask, then runs the Python handlers of signals already delivered: a
    KeyboardInterrupt can come out of the call that blocks. The mask must not stay blocked (every later child,
    spawned ones included, would inherit it)."""
    from pslab.collectives import forking
    real = signal.pthread_sigmask

    def sigmask(how, mask):
        old = real(how, mask)
        if how == signal.SIG_BLOCK and set(mask):
            raise KeyboardInterrupt          # a SIGINT delivered just before, its handler run now
        return old

    class NeverStarted:
        def start(self) -> None:
            raise AssertionError("started")

    before = real(signal.SIG_BLOCK, ())
    monkeypatch.setattr(signal, "pthread_sigmask", sigmask)
    with pytest.raises(KeyboardInterrupt):
        forking.start(NeverStarted(), "fork")
    monkeypatch.undo()
    assert real(signal.SIG_BLOCK, ()) == before
