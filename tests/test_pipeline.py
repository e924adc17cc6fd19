"""trainer/train/pipeline.py: batches built ahead on a thread are exactly the loop's own, in
order, with errors raised at the batch that hit them; finiteness read one step late, and
at once before a checkpoint. Timing belongs to benchmarks/input_pipeline.py."""

import threading

import pytest

from lctrain.trainer.train.pipeline import LaggedFiniteCheck, Prefetcher


def test_prefetched_batches_are_the_builders_in_order_from_the_start():
    threads = set()

    def build(index):
        threads.add(threading.current_thread().name)
        return ("batch", index)

    with Prefetcher(build, first=7, depth=3) as batches:
        got = [batches.get(index) for index in range(7, 20)]
    assert got == [("batch", index) for index in range(7, 20)]
    assert threads == {"lctrain-batches"}  # built off the loop's thread


def test_an_error_reaches_the_loop_at_the_batch_that_hit_it():
    def build(index):
        if index == 3:
            raise FileNotFoundError("tokens.bin")
        return index

    with Prefetcher(build, first=0) as batches:
        assert [batches.get(i) for i in range(3)] == [0, 1, 2]
        with pytest.raises(FileNotFoundError, match="tokens.bin"):
            batches.get(3)


def test_close_stops_a_thread_blocked_on_a_full_queue():
    batches = Prefetcher(lambda index: index, first=0, depth=1)
    batches.get(0)
    batches.close()
    assert not batches._thread.is_alive()


def test_finiteness_is_read_one_step_late_and_at_once_on_flush():
    seen = []
    check = LaggedFiniteCheck(lambda step, metrics: seen.append(step))
    check.push(1, {"finite": True})
    check.push(2, {"finite": False})
    assert seen == []            # step 2's flag not read yet: the device may still run it
    check.push(3, {"finite": True})
    assert seen == [2]
    check.push(4, {"finite": False})
    check.flush()                # before a checkpoint of step 4
    assert seen == [2, 4]
    check.flush()
    assert seen == [2, 4]        # each step's flag read once
