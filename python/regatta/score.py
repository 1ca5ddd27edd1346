"""``regatta.score.run(config)``: a scoring or generation run on this driver's cluster."""

from ._runs import score as run

__all__ = ["run"]
