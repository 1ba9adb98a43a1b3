"""A notifier stand-in for alert-engine tests: records what the engine submits, synchronously."""

from __future__ import annotations


class Capture:
    """Takes the place of a NotifierWorker: ``submit`` records the notification and reports it queued."""

    name = "capture"

    def __init__(self):
        self.sent = []
        self.undelivered = []  # as a NotifierWorker's: everything is delivered at once

    def submit(self, notification):
        self.sent.append(notification)
        return True

    def begin_close(self, deadline):
        pass

    def close(self, deadline):
        return True

    def alerts(self):
        """[(alert name, status)] over every notification submitted so far, in order."""
        return [(a.name, a.status) for n in self.sent for a in n.alerts]
