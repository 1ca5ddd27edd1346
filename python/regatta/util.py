"""Helpers in Ray's shape: placement groups (``placement_group``,
``PlacementGroupSchedulingStrategy``, ``remove_placement_group``) and ``ActorPool``."""

import cloudpickle

import regatta

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _bundle_text(bundle):
    if not isinstance(bundle, dict) or not bundle:
        raise ValueError(f"a bundle is a non-empty dict of resource amounts, not {bundle!r}")
    parts = []
    for name, amount in bundle.items():
        if not isinstance(amount, (int, float)) or amount < 0:
            raise ValueError(f"bundle amount {name}={amount!r} must be a number >= 0")
        parts.append(f"{name}={amount}")
    return ",".join(parts)


class _GroupReady:
    """What ``PlacementGroup.ready()``'s ObjectRef waits on."""

    def __init__(self, group):
        self._group = group
        self._done = False

    def done(self):
        if not self._done:
            self._done = self._group.ready(0.0) is not None
        return self._done

    def result(self, timeout=None):
        nodes = self._group.ready(1e9 if timeout is None else timeout)
        if nodes is None:
            return None
        self._done = True
        return "ok", b"O" + cloudpickle.dumps(True)


class PlacementGroup:
    """Bundles of resources reserved together (``placement_group(...)``)."""

    def __init__(self, group, bundles, strategy):
        self._group = group
        self.bundle_specs = bundles
        self.strategy = strategy

    @property
    def id(self):
        return self._group.id

    @property
    def bundle_count(self):
        return len(self.bundle_specs)

    def ready(self):
        """An ObjectRef that resolves once every bundle is reserved."""
        return regatta.ObjectRef(f"placement group {self.id}", _GroupReady(self._group))

    def wait(self, timeout_seconds=30):
        """Whether every bundle is reserved within ``timeout_seconds``."""
        return self._group.ready(float(timeout_seconds)) is not None

    def __repr__(self):
        return f"PlacementGroup({self.id}, {self.strategy}, {self.bundle_specs})"


def placement_group(bundles, strategy="PACK", name=""):
    """Reserves ``bundles`` (dicts such as ``{"CPU": 1, "GPU": 1}``) with ``strategy``
    (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD); a group no nodes could ever hold is refused
    at once."""
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(_STRATEGIES)}, not {strategy!r}")
    if not bundles:
        raise ValueError("a placement group needs at least one bundle")
    texts = [_bundle_text(b) for b in bundles]
    try:
        group = regatta._current().cluster.create_group(texts, strategy)
    except regatta._native.Infeasible as error:
        raise regatta.InfeasibleError(f"no node could ever hold this placement group: {error}") from None
    return PlacementGroup(group, [dict(b) for b in bundles], strategy)


def remove_placement_group(group):
    """Removes the group: its actors are killed and its resources freed."""
    group._group.remove()


class PlacementGroupSchedulingStrategy:
    """``.options(scheduling_strategy=...)``: place in a group's bundle (index -1: any)."""

    def __init__(self, placement_group, placement_group_bundle_index=-1,
                 placement_group_capture_child_tasks=None):
        if not isinstance(placement_group, PlacementGroup):
            raise TypeError("placement_group must be a regatta.util.PlacementGroup")
        if not -1 <= placement_group_bundle_index < placement_group.bundle_count:
            raise ValueError(f"bundle index {placement_group_bundle_index} is outside the group's "
                             f"{placement_group.bundle_count} bundles")
        self.placement_group = placement_group
        self.placement_group_bundle_index = placement_group_bundle_index


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
