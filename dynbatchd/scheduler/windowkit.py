"""What every wait-window policy shares: the clock's unit and the config key its options are
checked under. A leaf, so each policy module and `dynbatchd.scheduler.windows` import it alike."""

SECOND = 1_000_000_000   # nanoseconds per second (the scheduler's clock is integer nanoseconds)


def _where(channel: str) -> str:
    """The config key a window policy's option errors name."""
    return f"channels.{channel}.window.options"
