"""A user's model for the `callable` runner, used by the end-to-end tests.

echo_or_fail returns each input back, except that the input "fail" raises
(the worker must isolate it), "crash" (or any text starting so) kills the worker process outright and
"hang" never returns.
"""

import os
import time


def echo_or_fail(inputs):
    texts = [x for x in inputs if isinstance(x, str)]
    if any(t.startswith("crash") for t in texts):
        os._exit(3)
    if "hang" in texts:
        time.sleep(3600)
    if "fail" in texts:
        raise ValueError("this input is poison")
    return [x for x in inputs]
