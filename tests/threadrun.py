"""Running a generation on a thread in tests, so that one that hangs fails the test instead of the run."""

from __future__ import annotations

import threading


def drain(gen, timeout: float = 60) -> list:
    """list(gen) on a thread, failing (not hanging) past `timeout`; what it raised is raised."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = list(gen)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the generation hangs"
    if "exc" in box:
        raise box["exc"]
    return box["out"]
