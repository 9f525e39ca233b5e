"""The ``bandit`` window policy's old import path: its code lives in the scheduler
(`dynbatchd.scheduler.banditwindow`), beside every other window policy, and the built-in windows
plugin registers it from `dynbatchd.scheduler.windows.factories` (one table, one home). This
module stays for its entry point and for callers that import `BanditWindow` from here.
"""

from dynbatchd.scheduler.banditwindow import BanditWindow, _fractions, _Stats  # noqa: F401
