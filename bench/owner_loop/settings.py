"""What a run sends: the rate, the in flight it aims at, the mix, the windows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Settings:
    rate: float = 500.0
    in_flight: int = 2000
    #: seconds a streamed request lasts; None: what makes ``in_flight`` by Little's law
    duration_s: float | None = None
    stream_share: float = 0.8
    stream_events: int = 5
    seconds: float = 60.0
    ramp_s: float = 15.0
    rest_s: float = 5.0
    workers: int = 2
    clients: int = 1
    quick: bool = False

    def stream_duration(self) -> float:
        """A streamed request's seconds: a non-streamed one takes milliseconds (the fast fake
        answers at once), so the streams hold the in flight alone."""
        if self.duration_s is not None:
            return self.duration_s
        return self.in_flight / (self.rate * self.stream_share)

    def interval_ms(self) -> float:
        """The pace of the fake's events: it sleeps this long after each of the tokens."""
        return self.stream_duration() * 1000.0 / self.stream_events

    def expected_in_flight(self) -> float:
        return self.rate * self.stream_share * self.stream_duration()
