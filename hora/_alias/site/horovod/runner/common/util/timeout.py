"""``horovod.runner.common.util.timeout``: a deadline that raises :class:`TimeoutException` when passed."""

import time


class TimeoutException(Exception):
    def __init__(self, message: str):
        self.message = message
        super().__init__(message)


class Timeout:
    """``Timeout(seconds, message)``; ``message`` may contain ``{activity}``."""

    def __init__(self, timeout: float, message: str):
        self._timeout = timeout
        self._deadline = time.time() + timeout
        self._message = message

    def remaining(self) -> float:
        return max(0.0, self._deadline - time.time())

    def timed_out(self) -> bool:
        return time.time() > self._deadline

    def check_time_out_for(self, activity: str) -> None:
        if self.timed_out():
            text = self._message.format(activity=activity).rstrip()
            raise TimeoutException(f"{text}{'' if text.endswith('.') else '.'} Timeout after {self._timeout} seconds.")
