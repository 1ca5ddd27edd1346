"""Errors a Regatta driver sees, in Ray's names."""


class RegattaError(Exception):
    """The base of Regatta's errors."""


class TaskError(RegattaError):
    """A remote function or actor method raised. ``cause`` is the remote exception (when it
    could be pickled) and ``traceback_str`` its traceback; ``get`` raises an instance that
    is also an instance of the cause's class where that class allows it, so ``except
    ValueError`` still catches a remote ``ValueError``."""

    def __init__(self, function_name, traceback_str, cause=None):
        self.function_name = function_name
        self.traceback_str = traceback_str
        self.cause = cause
        super().__init__(f"{function_name} failed remotely:\n{traceback_str}")

    def __str__(self):
        return f"{self.function_name} failed remotely:\n{self.traceback_str}"

    def as_instanceof_cause(self):
        """This error, also an instance of the cause's class (when it can be)."""
        cause_class = type(self.cause) if self.cause is not None else None
        if cause_class is None or issubclass(cause_class, TaskError) or not issubclass(cause_class, Exception):
            return self
        try:
            combined = type(f"TaskError({cause_class.__name__})", (TaskError, cause_class), {
                "__init__": lambda s, *a, **k: None,
                "__str__": TaskError.__str__,
            })
            error = combined()
            error.function_name = self.function_name
            error.traceback_str = self.traceback_str
            error.cause = self.cause
            error.args = (str(self),)
            return error
        except TypeError:  # a class that cannot be combined (e.g. a C type with layout)
            return self


class ActorDiedError(RegattaError):
    """The actor is dead: its constructor failed, its process or node died and it was not
    restarted, or it was killed. The message says which, and ``cause`` names it for code:
    ``"constructor_failed"``, ``"killed"``, ``"job_ended"``, ``"group_removed"``,
    ``"unplaceable"``, ``"node_lost"`` (its node died, restarted or never took its start,
    past its restarts), ``"restarts_exhausted"`` (its own process kept dying), or
    ``"exited"`` (its process died during the call; it may be restarted)."""

    def __init__(self, message, cause=None):
        super().__init__(message)
        self.cause = cause


class WorkerCrashedError(RegattaError):
    """The process running a task died and the task's retries are spent."""


class GetTimeoutError(RegattaError, TimeoutError):
    """``get`` gave up waiting."""


class InfeasibleError(RegattaError, ValueError):
    """No node of the cluster could ever hold what an actor, a task or a placement group
    asks for (more of a resource than any node has, or one no node has): refused at once,
    naming what falls short. A request that only waits for resources held elsewhere is not
    an error: it runs when they are freed (and the driver warns after a while)."""
