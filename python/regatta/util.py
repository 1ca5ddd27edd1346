"""Helpers over actors, in Ray's shape: ``ActorPool``."""

import regatta


class ActorPool:
    """Spreads work over a fixed set of actors, one call per actor at a time.

        pool = ActorPool([Worker.remote() for _ in range(4)])
        results = list(pool.map(lambda actor, row: actor.score.remote(row), rows))

    ``fn(actor, value)`` must return the ObjectRef of one call on ``actor``.
    """

    def __init__(self, actors):
        self._idle = list(actors)
        if not self._idle:
            raise ValueError("ActorPool needs at least one actor")
        self._running = {}  # submission index -> (ref, actor)
        self._waiting = []  # (fn, value) not yet submitted
        self._next_submit = 0
        self._next_return = 0

    def has_free(self):
        """Whether an actor is idle."""
        return bool(self._idle) and not self._waiting

    def has_next(self):
        """Whether a result is pending."""
        return bool(self._running) or bool(self._waiting)

    def submit(self, fn, value):
        """Schedules ``fn(actor, value)`` on an idle actor, or queues it until one is."""
        if self._idle:
            actor = self._idle.pop()
            self._running[self._next_submit] = (fn(actor, value), actor)
            self._next_submit += 1
        else:
            self._waiting.append((fn, value))

    def _returned(self, index):
        ref, actor = self._running.pop(index)
        self._idle.append(actor)
        if self._waiting:
            fn, value = self._waiting.pop(0)
            self.submit(fn, value)
        return ref

    def get_next(self, timeout=None):
        """The next result in submission order."""
        if not self.has_next():
            raise StopIteration("no more results to get")
        while self._next_return not in self._running and self._next_return < self._next_submit:
            self._next_return += 1
        index = self._next_return
        ref, _actor = self._running[index]
        ready, _ = regatta.wait([ref], num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError("the next result did not come in time")
        self._next_return += 1
        return regatta.get(self._returned(index))

    def get_next_unordered(self, timeout=None):
        """Whichever pending result is done first."""
        if not self.has_next():
            raise StopIteration("no more results to get")
        by_ref = {id(ref): index for index, (ref, _) in self._running.items()}
        refs = [ref for ref, _ in self._running.values()]
        ready, _ = regatta.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError("no result came in time")
        index = by_ref[id(ready[0])]
        # Ordered reads skip what was taken out of order.
        ref = self._returned(index)
        while self._next_return not in self._running and self._next_return < self._next_submit:
            self._next_return += 1
        return regatta.get(ref)

    def map(self, fn, values):
        """Results of ``fn(actor, value)`` for each value, in order."""
        for value in values:
            self.submit(fn, value)
        while self.has_next():
            yield self.get_next()

    def map_unordered(self, fn, values):
        """Results of ``fn(actor, value)`` for each value, as they finish."""
        for value in values:
            self.submit(fn, value)
        while self.has_next():
            yield self.get_next_unordered()

    def pop_idle(self):
        """An idle actor taken out of the pool, or None."""
        return self._idle.pop() if self.has_free() else None

    def push(self, actor):
        """Adds an actor to the pool."""
        self._idle.append(actor)
        if self._waiting:
            fn, value = self._waiting.pop(0)
            self.submit(fn, value)
