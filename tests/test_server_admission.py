"""The bundled server under more requests than it can answer in time: rows of clients that left are not
computed, batches are bounded by the tokens they generate, a queue that would outlast the client's timeout
answers 429 with Retry-After, and teacher_gen's default concurrency follows the server's batches.

Nothing here depends on how fast this machine is: a gate holds the generation thread while a client times
out, and the pushback tests give the engine a measured speed instead of letting it measure one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from ars_opd.config import ConfigError, EndpointConfig, TeacherGenConfig, TeacherServerConfig
from ars_opd.serving.local_server import server_env
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server import engine as engine_module
from ars_opd.serving.server.admission import Limits, RowQueue, Throughput, budget, plan
from ars_opd.serving.server.handlers import ENGINE_KEY
from ars_opd.serving.server.jobs import Job, ScoreJob
from ars_opd.serving.server.options import ServerOptions
from ars_opd.teacher.client.cache import TeacherCache, cache_key
from ars_opd.teacher.client.chat import TeacherRequest, ask_all
from ars_opd.teacher.client.endpoint import ClientSettings, RetryableError, make_client, post_json
from ars_opd.teacher.client.generate import REMOTE_CONCURRENCY, resolve_concurrency
from fake_endpoint import FakeEndpoint
from server_thread import ServerThread
from tiny_models import save_tiny_model

MODEL = "tiny"


def _body(content: str, max_tokens: int = 4) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, char_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), char_tokenizer)


@pytest.fixture
def serve(model_dir):
    """Start a fresh server (fresh counters) with the given options; closed after the test."""
    servers = []

    def start(**options) -> ServerThread:
        srv = ServerThread(server_app.create_app(str(model_dir), ServerOptions(model_name=MODEL, **options)))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.close()


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _gate_generation(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold every batch's generate on the generation thread until ``release`` is set; ``entered`` is set when
    the first batch reaches it."""
    entered, release = threading.Event(), threading.Event()
    real = engine._generate_batch

    def gated(jobs):
        entered.set()
        assert release.wait(60), "the test never released the generation thread"
        real(jobs)

    monkeypatch.setattr(engine, "_generate_batch", gated)
    return entered, release


async def _ask(url: str, body: dict, timeout_s: float) -> dict:
    """One request through the client teacher_gen uses (its transport, its timeout handling)."""
    limits = EndpointConfig(endpoint=f"{url}/v1", model=MODEL, request_timeout_s=timeout_s, concurrency=4)
    client = make_client(ClientSettings(f"{url}/v1", limits=limits))
    try:
        return await post_json(client, "/chat/completions", body)
    finally:
        await client.close()


def _run_in_thread(coro_factory) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(coro_factory())), daemon=True)
    thread.start()
    return thread, out


def test_a_queued_request_whose_client_timed_out_is_never_generated(serve, monkeypatch):
    srv = serve(max_wait_ms=1)
    entered, release = _gate_generation(srv.app[ENGINE_KEY], monkeypatch)
    first, answered = _run_in_thread(lambda: _ask(srv.url, _body("first"), timeout_s=60))
    assert entered.wait(30)  # the first request's batch holds the generation thread
    with pytest.raises(RetryableError, match="timeout"):
        asyncio.run(_ask(srv.url, _body("second"), timeout_s=0.5))  # queued behind it; its client gives up
    _wait_for(lambda: srv.stats.clients_gone == 1, "the server to see the client go")
    release.set()
    first.join(30)
    assert answered and answered[0]["choices"][0]["finish_reason"] in ("stop", "length")
    _wait_for(lambda: srv.stats.rows_dropped == 1, "the abandoned row to be dropped")
    stats = srv.stats
    assert (stats.completions, stats.rows_generated, stats.generate_calls, stats.rows_stopped) == (2, 1, 1, 0)


def test_a_running_row_whose_client_timed_out_stops_at_the_next_step(serve, monkeypatch):
    srv = serve(max_wait_ms=1)
    entered, release = _gate_generation(srv.app[ENGINE_KEY], monkeypatch)
    with pytest.raises(RetryableError, match="timeout"):
        asyncio.run(_ask(srv.url, _body("alone", max_tokens=64), timeout_s=0.5))
    assert entered.is_set()  # its batch had started
    _wait_for(lambda: srv.stats.clients_gone == 1, "the server to see the client go")
    release.set()
    _wait_for(lambda: srv.stats.rows_stopped == 1, "the row to stop")
    # generate's first step ran (the prompt's forward), and nothing was recorded for the row after it
    assert (srv.stats.rows_generated, srv.stats.tokens_generated) == (1, 0)


def _row(max_tokens: int, cancelled: bool = False) -> Job:
    job = Job([1, 2], max_tokens, 0.0, 1.0, 0, (), False, loop=None, events=None)
    job.cancelled = cancelled
    return job


def test_batches_are_taken_in_order_within_the_row_and_token_limits():
    queue = RowQueue()
    rows = [_row(8), _row(8), _row(16), _row(8, cancelled=True), _row(100), _row(4), ScoreJob([1], 0, None, None)]
    for row in rows:
        queue.put(row)
    assert plan(queue, Limits(3, 32)) == [(2, 8), (1, 16), (1, 100), (1, 4)]  # (generating rows, longest)
    # two rows of 8 (16); a third of 16 would make 3 x 16 = 48: it starts the next batch
    assert queue.take(Limits(3, 32)) == ([rows[0], rows[1]], 0)
    # the cancelled row is dropped on the way; 100 > 32 after the 16-token row: the next batch again
    assert queue.take(Limits(3, 32)) == ([rows[2]], 1)
    assert queue.take(Limits(3, 32)) == ([rows[4]], 0)  # alone over the budget, it still runs: it cannot be split
    # a scoring row costs no decoding steps: it joins whatever batch has room
    assert queue.take(Limits(3, 32)) == ([rows[5], rows[6]], 0) and len(queue) == 0
    assert budget(rows[:3]) == 3 * 16 and budget([rows[6]]) == 0
    for row in rows:
        queue.put(row)
    assert [len(queue.take(Limits(64))[0]) for _ in range(2)] == [6, 0]  # no token limit: rows alone


def test_a_served_batch_never_exceeds_the_token_limit(serve, monkeypatch):
    srv = serve(max_wait_ms=1, max_batch_tokens=3 * 6)
    entered, release = _gate_generation(srv.app[ENGINE_KEY], monkeypatch)

    async def go():
        first = asyncio.create_task(_ask(srv.url, _body("first", max_tokens=6), timeout_s=60))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        rest = [asyncio.create_task(_ask(srv.url, _body(f"q{i}", max_tokens=6), timeout_s=60)) for i in range(9)]
        await asyncio.get_running_loop().run_in_executor(
            None, _wait_for, lambda: srv.stats.completions == 10, "the nine to queue"
        )
        release.set()  # nine rows of 6 tokens wait: three batches of three (3 x 6 = 18)
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(go())
    assert all(a["choices"][0]["finish_reason"] in ("stop", "length") for a in answers)
    stats = srv.stats
    assert (stats.generate_calls, stats.rows_generated, stats.largest_batch, stats.largest_batch_tokens) == (
        4,
        10,
        3,
        18,
    )


def test_the_wait_estimate_times_each_batch_by_a_step_model_fitted_to_recent_batches():
    now = [100.0]
    meter = Throughput(clock=lambda: now[0])
    assert meter.estimate_s([], _row(8), Limits(64)) is None  # nothing timed yet: no estimate, no pushback
    # steps of 0.005 s x (16 + rows); both batches ran 20 of their longest 40 steps (rows ended at EOS), the
    # 19 after the first (which includes the prompts' forward) timed
    meter.record(rows=4, steps=19, seconds=19 * 0.1, longest=40)
    meter.record(rows=24, steps=19, seconds=19 * 0.2, longest=40)
    assert meter.step_model() == pytest.approx((16 * 0.005, 0.005)) and meter.share() == 0.5
    queued = [_row(40) for _ in range(3)]
    # nothing running: the three and the new row make one batch of 4 rows, 20 steps of 0.1 s
    assert meter.estimate_s(queued, _row(40), Limits(64)) == pytest.approx(20 * 0.1)
    # under an 80-token limit two batches of two: the same tokens take longer in smaller batches
    assert meter.estimate_s(queued, _row(40), Limits(64, 80)) == pytest.approx(2 * 20 * 0.09)
    # a short row batched with a long one runs the long one's steps
    assert meter.estimate_s([_row(40)], _row(10), Limits(64)) == pytest.approx(20 * 0.09)
    # under pushback a batch is also held to a time as the model says: 20 x 0.005 x (16 + rows) <= 2 s
    assert meter.limits(64, None, None) == Limits(64)  # no pushback: rows and tokens only
    limits = meter.limits(64, None, 2.0)
    queue = RowQueue()
    for _ in range(12):
        queue.put(_row(40))
    assert [len(queue.take(limits)[0]) for _ in range(4)] == [4, 4, 4, 0]
    assert Throughput().limits(64, 1536, 2.0) == Limits(64, 1536)  # nothing timed yet: no time limit
    meter.begin(rows=10, longest=40)  # before its steps are timed: the model's 20 x 0.13 s, less the time spent
    now[0] += 1.0
    assert meter.running_left_s(meter.step_model()) == pytest.approx(20 * 0.13 - 1.0)
    meter.step()  # the first step ends: the others are timed from here
    for _ in range(9):
        meter.step()
    now[0] += 4.5  # 9 more steps in 4.5 s, slower than the model said: 10 steps to go at its own 0.5 s
    assert meter.running_left_s(meter.step_model()) == pytest.approx(10 * 0.5)
    fixed, per_row = meter.step_model()  # and the slow steps join the model at once
    assert fixed + 10 * per_row > 0.13
    meter.end(complete=False)  # cut short by clients that left: its steps are timed, its share is not known
    assert len(meter._done) == 3 and meter.share() == 0.5 and meter.running is None
    one_size = Throughput(clock=lambda: now[0])
    one_size.record(rows=16, steps=10, seconds=2.0, longest=10)  # 0.2 s a step at 16 rows: c = 0.2 / 32
    assert one_size.step_model() == pytest.approx((0.1, 0.2 / 32)) and one_size.share() == 1.0


def test_a_request_that_would_outwait_the_limit_gets_429_with_retry_after(serve, monkeypatch):
    srv = serve(max_wait_ms=1, max_queue_s=5.3)
    engine = srv.app[ENGINE_KEY]
    entered, release = _gate_generation(engine, monkeypatch)
    # a timed batch of 4 rows, 100 steps of 0.02 s: a step takes 0.001 s x (16 + rows), so a batch of n rows
    # of 100 tokens takes 1.6 + 0.1 n s, and under half the limit (2.65 s) holds at most 10 rows
    engine.throughput.record(rows=4, steps=100, seconds=2.0, longest=100)

    async def go():
        loop = asyncio.get_running_loop()
        # a 4-token batch of one row holds the generation thread: at most 4 x 0.017 s left by the model
        running = [asyncio.create_task(_ask(srv.url, _body("first"), timeout_s=60))]
        await loop.run_in_executor(None, entered.wait, 30)
        # rows 1-10 queue as one batch (2.6 s), rows 11-20 as the next: the 20th waits 5.2-5.27 s, within 5.3
        for i in range(20):
            running.append(asyncio.create_task(_ask(srv.url, _body(f"q{i}", max_tokens=100), timeout_s=60)))
            await loop.run_in_executor(None, _wait_for, lambda: srv.stats.completions == i + 2, "a queued row")
        try:  # the 21st would start a third batch: 2.6 + 2.6 + 1.7 s
            await _ask(srv.url, _body("one too many", max_tokens=100), timeout_s=20)
        except RetryableError as e:
            refused = e
        release.set()
        return refused, await asyncio.gather(*running)

    refused, answers = asyncio.run(go())
    # the client reads the status and the header it must wait for: 1.6-1.67 s over the limit, rounded up
    assert refused.reason.startswith("http_429") and "about 7 s" in refused.reason and refused.wait_s == 2.0
    assert len(answers) == 21 and all(a["choices"] for a in answers)  # none of the admitted was refused
    assert (srv.stats.pushed_back, srv.stats.completions) == (1, 21)


def test_nothing_is_pushed_back_before_a_speed_is_measured(serve, monkeypatch):
    srv = serve(max_wait_ms=1, max_queue_s=0.001)
    entered, release = _gate_generation(srv.app[ENGINE_KEY], monkeypatch)

    async def go():
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(_ask(srv.url, _body("first"), timeout_s=60))]
        await loop.run_in_executor(None, entered.wait, 30)
        tasks += [asyncio.create_task(_ask(srv.url, _body(f"q{i}", max_tokens=100), timeout_s=60)) for i in range(5)]
        await loop.run_in_executor(None, _wait_for, lambda: srv.stats.completions == 6, "the queue")
        release.set()
        return await asyncio.gather(*tasks)

    # the first batch has not ended: no speed measured, so no estimate to refuse by (the limit is 1 ms)
    assert len(asyncio.run(go())) == 6 and srv.stats.pushed_back == 0


def test_teacher_gens_default_concurrency_is_two_of_the_bundled_servers_batches():
    cfg = TeacherGenConfig()  # params.yaml's defaults: concurrency null, 32 tokens, batches of 64 rows / 1536 tokens
    assert cfg.concurrency is None and resolve_concurrency(cfg) == 2 * (1536 // 32)
    assert resolve_concurrency(replace(cfg, max_tokens=48)) == 2 * 32
    assert resolve_concurrency(replace(cfg, max_tokens=8)) == 2 * 64  # max_batch_size is the tighter limit
    assert resolve_concurrency(replace(cfg, max_tokens=4096)) == 2  # one row per batch, one running, one waiting
    no_token_limit = replace(cfg, server=TeacherServerConfig(max_batch_tokens=None))
    assert resolve_concurrency(replace(no_token_limit, max_tokens=2048)) == 2 * 64
    assert resolve_concurrency(replace(cfg, concurrency=7)) == 7  # a number is honoured
    remote = TeacherGenConfig(endpoint="http://127.0.0.1:9/v1", model="m")
    assert resolve_concurrency(remote) == REMOTE_CONCURRENCY
    with pytest.raises(ConfigError, match="concurrency: must be in 1..4096, got None"):
        EndpointConfig(concurrency=None)  # only teacher_gen derives it; opd's scoring endpoint needs a number


def test_each_429_takes_a_request_out_of_flight_until_a_calm_spell_and_429s_use_no_attempt(tmp_path):
    """A server that pushes back is at its limit: the client keeps asking, with one request fewer in flight per
    429 (the worker hands its prompt on and leaves), instead of sending the same excess again and again (each
    429 is a request); after twice as many answers as are in flight with no 429, one more goes in flight. A
    quarter of the workers start first; a prompt pushed back more often than max_attempts is still answered."""
    requests = [
        TeacherRequest(
            cache_key({"q": i}), {"model": "fake-teacher", "messages": [{"role": "user", "content": f"q{i}"}]}, {"q": i}
        )
        for i in range(80)
    ]
    limits = EndpointConfig(
        concurrency=8, request_timeout_s=10, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01
    )
    # two workers start, get 429 and leave; the six others start, two take the handed-on prompts (which wait
    # the retry-after), four new ones are sent, get 429 and leave: six 429s, two workers left
    with (
        FakeEndpoint(latency_s=0.05, pushback_first=6, retry_after_s=0.05) as ep,
        TeacherCache(tmp_path / "c") as cache,
    ):
        summary = asyncio.run(ask_all(requests, cache, ClientSettings(ep.base_url, limits=limits), progress=False))
    assert summary.completed == 80 and summary.failed == 0
    assert (summary.pushed_back, summary.retries) == (6, 6)
    in_flight = [e["in_flight"] for e in ep.log]
    assert max(in_flight[:2]) <= 2 < max(in_flight[:6])  # a quarter at once, the rest after the first answer
    assert max(in_flight[8:10]) <= 8 - 6  # six 429s (the last four still in flight beside the 7th and 8th): two
    # then one more after 4, 6, 8, 10, 12 and 14 answers: all eight again after 54 of the 74 left
    assert summary.concurrency == 8 and max(in_flight[-10:]) > 2
    # every prompt pushed back was asked again, after its retry-after, and answered once
    pushed = [e["prompt"] for e in ep.log if e["outcome"] == "429"]
    assert len(set(pushed)) == 6 and all(sum(e["prompt"] == p for e in ep.log) == 2 for p in pushed)


def test_the_started_servers_threads_wait_passively_unless_the_caller_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = server_env("/checkout")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PYTHONPATH"] == os.pathsep.join(["/checkout", "/elsewhere"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert server_env("/checkout")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_batch_waits_for_a_burst_to_finish_arriving(monkeypatch):
    """The batcher waits max_wait_ms, and again while rows kept arriving and less than a batch waits: a burst
    of requests takes tens of milliseconds to arrive, and a batch started after its first few would leave the
    rest a batch behind. Each wait here is replaced by the arrival of a scripted number of rows."""

    def waits_for(arrivals: list[int], limits: Limits) -> int:
        queue, waited = RowQueue(), []
        queue.put(_row(8))

        async def arrive(_seconds):
            for _ in range(arrivals[len(waited)]):
                queue.put(_row(8))
            waited.append(_seconds)

        monkeypatch.setattr(engine_module.asyncio, "sleep", arrive)
        stub = SimpleNamespace(_pending=queue, max_wait_s=0.005, _limits=lambda: limits)
        asyncio.run(engine_module.TeacherEngine._gather(stub))
        monkeypatch.undo()
        assert all(s == 0.005 for s in waited)
        return len(waited)

    assert waits_for([3, 2, 0, 9], Limits(64)) == 3  # until a wait brings nobody
    assert waits_for([3, 2, 0, 9], Limits(4)) == 2  # until more than a batch waits
    assert waits_for([1] * 30, Limits(64)) == engine_module.GATHER_WAITS  # a trickle: at most this many
    assert waits_for([0], Limits(64)) == 1  # a lone request waits max_wait_ms once, as it always did
