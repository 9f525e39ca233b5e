"""The `callable` runner's checks on the function it is given: a target that is not callable fails
the load (it once loaded, and every request then failed `model_error`), and a result that is not a
list of outputs fails the batch (a dict of as many keys once answered each input with a key)."""

from __future__ import annotations

import pytest

from dynbatchd.devices.runners import CallableRunner

NOT_A_FUNCTION = {"answer": 42}


def as_dict(inputs):
    return {i: text for i, text in enumerate(inputs)}


def as_text(inputs):
    return "ab"


def echo(inputs):
    return list(inputs)


def runner(target: str) -> CallableRunner:
    loaded = CallableRunner("cpu", {"target": f"{__name__}:{target}"})
    loaded.load()
    return loaded


def test_a_target_that_is_not_callable_fails_the_load_naming_it():
    with pytest.raises(ValueError, match=r"NOT_A_FUNCTION is a dict, not a function"):
        runner("NOT_A_FUNCTION")


@pytest.mark.parametrize("target, kind", [("as_dict", "dict"), ("as_text", "str")])
def test_a_result_that_is_not_a_list_of_outputs_fails_the_batch(target, kind):
    with pytest.raises(ValueError, match=f"returned a {kind}, not a list of outputs"):
        runner(target).run(["x", "y"], [1, 1])


def test_a_list_of_outputs_is_answered_as_it_is():
    assert runner("echo").run(["x", "y"], [1, 1]) == ["x", "y"]
