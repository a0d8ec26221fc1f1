"""The bundled server as a local subprocess: the teacher for the stages that ask one (teacher_gen, opd), or
the student as opd's rollout engine.

``local_server`` starts ``python -m ars_opd.serving.server`` for a model directory on 127.0.0.1 (an
ephemeral port, reported through a ready file), yields its base URL, and stops it afterwards, also on
errors and Ctrl-C. It names the server only on that command line: nothing here imports it.
The server runs in its own session (a Ctrl-C at the terminal reaches this process, which stops it in order)
and watches this process (``--parent-pid``): a ``kill -9`` here, which runs no cleanup, stops it within a
second or two instead of leaving it serving. Its OpenMP threads wait passively (``SERVER_ENV``): on a shared
machine spinning threads slow it several times over.

The server loads the tokenizer of ``model_dir`` itself (the model's own: vocabulary, chat template, EOS), never
the pipeline's shared ``tokenizer/``: for a teacher with a tokenizer of its own (``opd.cross_tokenizer``) that is
the teacher's, which teacher_gen checks (``ars_opd.teacher.client.generate.check_served_tokenizer``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from ars_opd.config import TeacherServerConfig

LOCAL_MODEL_NAME = "ars-opd-teacher"
# OpenMP threads (torch's libgomp) spin at every barrier before they sleep: on cores that other work keeps busy
# a spinning thread holds a core its partner needs: HF generate of SmolLM2-135M on 2 threads, beside other
# jobs (load average 4-6 on 2 cores), made 4-14 tokens/s spinning and 31-39 passive (batches of 16 and 32).
# The caller's environment wins: OMP_WAIT_POLICY=ACTIVE brings the spinning back.
SERVER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


class LocalServerError(RuntimeError):
    """The bundled server exited, or was not ready in time."""


# Runs in the child before the server's program replaces it (exec keeps the PID and the death signal): ask
# Linux to send SIGTERM when the parent (the process that started the server) dies, then exec the command.
# If the parent is already gone by then, exit instead of serving. Elsewhere (no prctl) the command just runs.
_EXIT_WITH_PARENT = """
import ctypes, os, signal, sys
parent, cmd = int(sys.argv[1]), sys.argv[2:]
if sys.platform.startswith("linux"):
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)) != 0:  # PR_SET_PDEATHSIG
        sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
    if os.getppid() != parent:
        sys.exit("the process that started this server is gone")
os.execv(cmd[0], cmd)
"""


def exit_with_parent(cmd: Sequence[str], python: str | None = None) -> list[str]:
    """``cmd`` (its first item an executable's path) wrapped so that it gets SIGTERM when this process dies.

    For a server started in a session of its own (``start_new_session``: a Ctrl-C at the terminal reaches the
    stage, which then stops the server in order): a ``kill -9`` of the stage runs no cleanup, and without this
    the server would serve on, orphaned (vLLM also idles at a fifth of a core). ``python`` runs the few lines
    that set the death signal before the exec (default: this interpreter). Linux sends the signal when the
    *thread* that started the child exits, so start such a server from a thread that outlives it (the stages
    and the CLI start theirs from the main thread).
    """
    return [python or sys.executable, "-c", _EXIT_WITH_PARENT, str(os.getpid()), *cmd]


def server_env(root: str) -> dict[str, str]:
    """The server process's environment: this one over ``SERVER_ENV``, with ``root`` (the checkout whose
    ``ars_opd`` this process runs) first on ``PYTHONPATH``, so the server runs the same code."""
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**SERVER_ENV, **os.environ, "PYTHONPATH": path}


def batch_rows(server: TeacherServerConfig, max_tokens: int) -> int:
    """How many requests of ``max_tokens`` each one batch of the bundled server takes: ``max_batch_size``, or
    fewer where ``max_batch_tokens`` (rows × longest max_tokens) is the tighter limit; at least one."""
    if server.max_batch_tokens is None:
        return server.max_batch_size
    return max(1, min(server.max_batch_size, server.max_batch_tokens // max_tokens))


@contextlib.contextmanager
def local_server(
    model_dir: str,
    server: TeacherServerConfig,
    model_name: str = LOCAL_MODEL_NAME,
    log_requests: str | None = None,
    max_logprobs: int | None = None,
    extra_args: Sequence[str] = (),
    request_timeout_s: float | None = None,
) -> Iterator[str]:
    """Start the bundled server for ``model_dir`` on 127.0.0.1 (ephemeral port); yield its base URL.

    ``max_logprobs``: the largest ``prompt_logprobs`` k it answers (OPD scoring; the server's default if None).
    ``extra_args``: further command-line flags (e.g. ``--weight-updates`` for a rollout engine).
    ``request_timeout_s``: the client's timeout; with ``server.max_queue_fraction`` the server pushes back (429,
    Retry-After) requests it estimates would wait longer than that fraction of it.
    """
    with tempfile.TemporaryDirectory(prefix="ars-opd-serve-") as tmp:
        ready = Path(tmp) / "ready.json"
        log = open(Path(tmp) / "server.log", "w+")
        cmd = [
            sys.executable,
            "-m",
            "ars_opd.serving.server",
            model_dir,
            "--model-name",
            model_name,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--max-batch-size",
            str(server.max_batch_size),
            "--max-wait-ms",
            str(server.max_wait_ms),
            "--threads",
            str(server.threads),
            "--parent-pid",  # it lives in its own session: without this a kill -9 of this process orphans it
            str(os.getpid()),
        ]
        if server.max_batch_tokens is not None:
            cmd += ["--max-batch-tokens", str(server.max_batch_tokens)]
        if server.max_queue_fraction is not None and request_timeout_s is not None:
            cmd += ["--max-queue-s", str(server.max_queue_fraction * request_timeout_s)]
        if log_requests:
            cmd += ["--log-requests", log_requests]
        if max_logprobs is not None:
            cmd += ["--max-logprobs", str(max_logprobs)]
        cmd += list(extra_args)
        # the server runs this process's ars_opd (a worktree or checkout), not whichever one is installed
        root = str(Path(__file__).resolve().parents[2])
        env = server_env(root)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + server.startup_timeout_s
            while not ready.exists():
                if proc.poll() is not None:
                    log.seek(0)
                    raise LocalServerError(
                        f"the local server for {model_dir} exited with {proc.returncode} "
                        f"before it was ready:\n{log.read()[-2000:]}"
                    )
                if time.monotonic() > deadline:
                    raise LocalServerError(
                        f"the local server for {model_dir} was not ready after {server.startup_timeout_s:.0f} s"
                    )
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            yield f"http://{info['host']}:{info['port']}/v1"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
