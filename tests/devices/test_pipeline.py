"""The pipelined worker's core (dynbatchd.devices.pipeline): stages overlap, results come out in
order, a failing input is isolated and an out-of-memory reported exactly as the serial `execute`
does. Overlap is proven by handshakes between the stages (a stage waits for an event that only an
overlapping stage can set, and the test fails on the timeout), never by timing."""

from __future__ import annotations

import select
import threading
import time

import numpy as np
import pytest
import zmq

from dynbatchd.devices.execution import OutOfMemory, execute
from dynbatchd.devices.pipeline import Finished, Pipeline
from dynbatchd.devices.runners import OptionError, Runner, SimulatedRunner, StagedRunner, check_options

TIMEOUT = 10.0   # generous: only reached when the stages do not overlap


def run_all(runner, batches: list[list], model: str = "m") -> list[Finished]:
    sent: list[Finished] = []
    pipe = Pipeline(sent.append)
    try:
        for i, inputs in enumerate(batches):
            pipe.submit(i, runner, model, inputs, [len(str(x)) for x in inputs])
        pipe.flush()
    finally:
        pipe.close()
    return sent


def answers(run) -> list:
    """Per-input outputs (None where it failed), whether the batch ran whole or was split."""
    rows = run.batch if run.batch is not None else run.outputs
    return [None if i in run.errors else (np.asarray(rows[i]).tolist()) for i in range(len(rows))]


class Handshakes(StagedRunner):
    """Stages that wait for one another: forward(k) needs prepare(k+1) to have started and
    finish(k) needs forward(k+1) to have started. A serial worker can do neither (it times out)."""

    def __init__(self, batches: int):
        super().__init__("cpu", {})
        self.prepared = [threading.Event() for _ in range(batches)]
        self.forwarding = [threading.Event() for _ in range(batches)]
        self.overlaps: list[tuple[str, int, bool]] = []
        self.batches = batches

    def prepare(self, inputs, tokens):
        k = inputs[0]
        self.prepared[k].set()
        return k

    def forward(self, k):
        self.forwarding[k].set()
        if k + 1 < self.batches:
            self.overlaps.append(("prepare of the next during forward", k, self.prepared[k + 1].wait(TIMEOUT)))
        return k

    def finish(self, k):
        if k + 1 < self.batches:
            self.overlaps.append(("finish during the next one's forward", k, self.forwarding[k + 1].wait(TIMEOUT)))
        return [k * 10]


def test_while_a_batch_is_on_the_device_the_next_is_prepared_and_the_last_finished():
    runner = Handshakes(5)
    sent = run_all(runner, [[k] for k in range(5)])
    assert runner.overlaps and all(ok for _, _, ok in runner.overlaps), runner.overlaps
    assert len(runner.overlaps) == 8
    assert [f.batch_id for f in sent] == [0, 1, 2, 3, 4]
    assert [answers(f.run) for f in sent] == [[0], [10], [20], [30], [40]]


class Gated(StagedRunner):
    """forward blocks until the test opens its gate, so the test sees what waits where."""

    def __init__(self):
        super().__init__("cpu", {})
        self.gate = threading.Event()
        self.forwarded: list[int] = []

    def prepare(self, inputs, tokens):
        return inputs[0]

    def forward(self, k):
        self.gate.wait(TIMEOUT)
        self.forwarded.append(k)
        return k

    def finish(self, k):
        return [k]


def test_at_most_one_batch_waits_for_the_device_and_submit_returns_once_the_device_has_its_batch():
    runner, sent = Gated(), []
    pipe = Pipeline(sent.append)
    pipe.submit(0, runner, "m", [0], [1])     # taken by the device at once: returns
    second = threading.Thread(target=pipe.submit, args=(1, runner, "m", [1], [1]))
    second.start()
    second.join(0.2)
    assert second.is_alive(), "submit returned while the device still had the batch before"
    runner.gate.set()
    second.join(TIMEOUT)
    assert not second.is_alive()
    pipe.close()
    assert [f.batch_id for f in sent] == [0, 1] and runner.forwarded == [0, 1]


def test_the_wake_descriptor_says_when_a_batch_left_the_device_and_collect_sends_it():
    runner, sent = Gated(), []
    pipe = Pipeline(sent.append)
    pipe.submit(7, runner, "m", [7], [1])
    pipe.collect()
    assert sent == [], "collect never waits for the device"
    runner.gate.set()
    readable, _, _ = select.select([pipe], [], [], TIMEOUT)
    assert readable == [pipe]
    poller = zmq.Poller()   # as the worker polls it, beside its socket
    poller.register(pipe.fileno(), zmq.POLLIN)
    assert dict(poller.poll(0)) == {pipe.fileno(): zmq.POLLIN}
    pipe.collect()
    assert [f.batch_id for f in sent] == [7]
    assert select.select([pipe], [], [], 0)[0] == [], "collect drains the wake-ups"
    pipe.close()


class Picky(StagedRunner):
    """Fails in one stage on the input named for it; `check` refuses ints."""

    def check(self, item):
        return "text only" if isinstance(item, int) else None

    def prepare(self, inputs, tokens):
        if "bad-prepare" in inputs:
            raise ValueError("tokenizer choked")
        return list(inputs)

    def forward(self, inputs):
        if "bad-forward" in inputs:
            raise RuntimeError("kernel failed")
        return inputs

    def finish(self, inputs):
        if "bad-finish" in inputs:
            raise ValueError("cannot convert")
        return [len(s) for s in inputs]


@pytest.mark.parametrize("bad", ["bad-prepare", "bad-forward", "bad-finish"])
def test_a_failing_input_is_isolated_whatever_stage_fails_and_the_others_of_its_batch_are_answered(bad):
    batches = [["a", "bb"], ["ccc", bad, "dddd", "e"], ["ff"]]
    sent = run_all(Picky("cpu", {}), batches)
    assert [f.batch_id for f in sent] == [0, 1, 2]
    assert answers(sent[0].run) == [1, 2] and answers(sent[2].run) == [2]
    failed = sent[1].run
    assert list(failed.errors) == [1] and "model m failed on this input" in failed.errors[1]
    assert answers(failed) == [3, None, 4, 1]
    serial = execute(Picky("cpu", {}), batches[1], [1] * 4, "m")
    assert serial.errors == failed.errors and answers(serial) == answers(failed)


def test_an_input_the_runner_refuses_is_rejected_alone_as_execute_does():
    sent = run_all(Picky("cpu", {}), [["a", 5, "ccc"]])
    run = sent[0].run
    assert run.rejected == {1: "text only"} and run.errors == {1: "text only"}
    assert answers(run) == [1, None, 3]


def test_a_tensor_the_worker_cannot_rebuild_is_rejected_alone_and_its_batch_answered():
    from dynbatchd import protocol as P
    from dynbatchd.devices.worker import decode_inputs

    # A shape numpy cannot hold (the front door refuses it too: this is the worker's own guard).
    msg = P.BatchMsg(1, "m", [P.BatchItem(text="a"), P.BatchItem(tensor=P.TensorRef("uint8", [0, 2**63])),
                              P.BatchItem(text="ccc")])
    inputs, _ = decode_inputs(msg, [b""])
    run = run_all(Picky("cpu", {}), [inputs])[0].run
    assert list(run.rejected) == [1] and "tensor could not be decoded" in run.rejected[1]
    assert answers(run) == [1, None, 3]


def test_an_out_of_memory_in_forward_is_reported_and_the_halves_answered_as_execute_does():
    options = {"base_ms": 0.0, "per_item_ms": 0.0, "memory_items": 2}
    inputs = ["a", "bb", "ccc", "dddd"]
    sent = run_all(SimulatedRunner("cpu", options), [inputs, ["x"]])
    serial = execute(SimulatedRunner("cpu", options), inputs, [1, 2, 3, 4], "m")
    run = sent[0].run
    assert run.oom and serial.oom and not run.errors
    assert answers(run) == answers(serial) == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert not sent[1].run.oom and answers(sent[1].run) == [[1, 1]]


def test_a_single_input_that_does_not_fit_gets_the_out_of_memory_error():
    runner = SimulatedRunner("cpu", {"base_ms": 0.0, "per_item_ms": 0.0, "memory_tokens": 3})
    sent = run_all(runner, [["ab", "abcdefg"]])
    run = sent[0].run
    assert run.oom and run.errors == {1: "out of device memory for a single input"}
    assert answers(run) == [[2, 2], None]


class Timed(StagedRunner):
    def prepare(self, inputs, tokens):
        time.sleep(0.03)
        return inputs

    def forward(self, inputs):
        time.sleep(0.05)
        return inputs

    def finish(self, inputs):
        return list(inputs)


def test_compute_ns_is_the_device_stage_and_the_cpu_stages_are_reported_beside_it():
    finished = run_all(Timed("cpu", {}), [["a"]])[0]
    assert finished.compute_ns >= 50_000_000 and finished.prepare_ns >= 30_000_000
    assert finished.finish_ns >= 0 and finished.simulated is False

    class DeviceTimed(Timed):
        def device_ns(self, output):
            return 12_345

    assert run_all(DeviceTimed("cpu", {}), [["a"]])[0].compute_ns == 12_345
    assert run_all(SimulatedRunner("cpu", {"base_ms": 0.0}), [["a"]])[0].simulated is True


class OnlyRun(Runner):
    """A third-party runner of the old kind: `run` alone."""

    def run(self, inputs, tokens):
        if "boom" in inputs:
            raise OutOfMemory("too big")
        return np.array([[len(x)] for x in inputs], dtype=np.float32)


def test_a_runner_with_only_run_goes_through_the_pipeline_unchanged():
    sent = run_all(OnlyRun("cpu", {}), [["a", "bb"], ["boom", "ccc"]])
    assert answers(sent[0].run) == [[1.0], [2.0]]
    assert sent[1].run.oom and answers(sent[1].run) == [None, [3.0]]


def test_results_stay_in_order_across_many_batches_of_the_simulated_runner():
    batches = [[f"{k}-{i}" * (k % 3 + 1) for i in range(k % 4 + 1)] for k in range(30)]
    sent = run_all(SimulatedRunner("cpu", {"base_ms": 0.2, "per_item_ms": 0.0, "cpu_ms_per_item": 0.05}), batches)
    assert [f.batch_id for f in sent] == list(range(30))
    for f, inputs in zip(sent, batches):
        assert answers(f.run) == [[len(x), len(x)] for x in inputs]


def test_the_simulated_runners_stages_give_what_run_gives():
    runner = SimulatedRunner("cpu", {"base_ms": 0.0, "per_item_ms": 0.0, "cpu_ms_per_item": 0.1})
    inputs, tokens = ["a", np.zeros(5), [1, 2], {"x": 1}], [3, 4, 5, 6]
    staged = runner.finish(runner.forward(runner.prepare(inputs, tokens)))
    np.testing.assert_array_equal(staged, runner.run(inputs, tokens))
    np.testing.assert_array_equal(staged, np.array([[1, 3], [5, 4], [2, 5], [0, 6]], np.float32))


def test_cpu_ms_per_item_is_cpu_really_used_in_prepare_and_the_device_sleep_uses_none():
    runner = SimulatedRunner("cpu", {"base_ms": 30.0, "per_item_ms": 0.0, "cpu_ms_per_item": 2.0})
    inputs, tokens = ["x"] * 10, [1] * 10
    before = time.thread_time_ns()
    prepared = runner.prepare(inputs, tokens)
    assert time.thread_time_ns() - before >= 20_000_000, "10 items x 2 ms of this thread's CPU"
    before = time.thread_time_ns()
    runner.forward(prepared)
    assert time.thread_time_ns() - before < 20_000_000, "the simulated device sleeps"


def test_cpu_ms_per_item_is_checked_like_the_other_options():
    check_options(SimulatedRunner, {"cpu_ms_per_item": 0.5, "base_ms": 1})
    with pytest.raises(OptionError) as bad:
        check_options(SimulatedRunner, {"cpu_ms_per_item": -1})
    assert bad.value.option == "cpu_ms_per_item" and ">= 0" in bad.value.rule
    with pytest.raises(OptionError) as typo:
        check_options(SimulatedRunner, {"cpu_ms_per_itme": 1})
    assert "did you mean `cpu_ms_per_item`" in typo.value.rule


def test_two_feeders_of_one_simulated_device_take_turns_at_it(tmp_path, monkeypatch):
    # Feeder processes of one device share its lock file: while one holds the (simulated) device,
    # another's forward waits, as a GPU's kernels would; its device time is the sleep alone.
    import fcntl
    import threading

    from dynbatchd.devices.runners import DEVICE_LOCKS_ENV, SimulatedRunner

    monkeypatch.setenv(DEVICE_LOCKS_ENV, str(tmp_path))
    runner = SimulatedRunner("cuda:0", {"base_ms": 1.0, "per_item_ms": 0.0})
    prepared = runner.prepare(["a"], [1])
    runner.finish(runner.forward(prepared))                 # creates the device's lock file
    [lock_path] = list(tmp_path.iterdir())
    done = threading.Event()
    with open(lock_path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)                     # another feeder holds the device
        worker = threading.Thread(target=lambda: (runner.forward(prepared), done.set()))
        worker.start()
        assert not done.wait(0.3)                            # so this one waits its turn
        fcntl.flock(held, fcntl.LOCK_UN)
    assert done.wait(10)
    worker.join()
    output = runner.forward(prepared)
    assert runner.device_ns(output) == 1_000_000             # the sleep alone, not the wait


class InlineThreads(Runner):
    """A runner with nothing to overlap (`INLINE`, as noop): records the thread each batch ran in."""
    INLINE = True

    def __init__(self):
        super().__init__("cpu", {})
        self.threads: list[str] = []

    def run(self, inputs, tokens):
        self.threads.append(threading.current_thread().name)
        return list(inputs)


def test_an_inline_runner_runs_in_the_callers_thread_and_after_a_pipelined_batch_before_it():
    sent: list[Finished] = []
    pipe = Pipeline(sent.append)
    inline, staged = InlineThreads(), SimulatedRunner("cpu", {"base_ms": 0.0, "per_item_ms": 0.0})
    try:
        pipe.submit(0, staged, "sim", ["a"], [1])      # on the device thread
        pipe.submit(1, inline, "noop", ["b", "c"], [1, 1])
        assert [f.batch_id for f in sent] == [0, 1]    # sent before submit returned, in order
        pipe.submit(2, inline, "noop", ["d"], [1])
        assert [f.batch_id for f in sent] == [0, 1, 2]
    finally:
        pipe.close()
    assert inline.threads == [threading.current_thread().name] * 2
    assert answers(sent[1].run) == ["b", "c"]
