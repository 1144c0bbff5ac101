"""fusectl/background.py: work on a daemon thread, its value or its error handed back."""

from __future__ import annotations

import threading

import pytest

from fusectl.background import Background


def test_the_value_comes_back_from_another_thread():
    where = []
    work = Background(lambda: where.append(threading.current_thread().name) or 7, name="fusectl-test")
    assert work.result() == 7 and where == ["fusectl-test"]


def test_the_error_is_raised_by_result_not_lost():
    def fail():
        raise ValueError("from the thread")

    work = Background(fail)
    with pytest.raises(ValueError, match="from the thread"):
        work.result()


def test_the_thread_is_a_daemon_so_an_interrupt_does_not_wait_for_it():
    gate = threading.Event()
    work = Background(gate.wait)
    assert work._thread.daemon
    gate.set()
    assert work.result() is True
