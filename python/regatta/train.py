"""``regatta.train.run(config)``: a training run on this driver's cluster."""

from ._runs import train as run

__all__ = ["run"]
