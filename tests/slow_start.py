"""A user's model for the `callable` runner that is slow only at first (a cold start).

Its first SLOW_BATCHES batches in each worker process take SLOW_S each; later ones take no
time. The daemon's workers import this module, so it stays standard library.
"""

import time

SLOW_BATCHES = 2
SLOW_S = 1.5
_batches = 0


def slow_first_batches(inputs):
    global _batches
    _batches += 1
    if _batches <= SLOW_BATCHES:
        time.sleep(SLOW_S)
    return list(inputs)
