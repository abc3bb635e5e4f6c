"""The engine core: requests as data (request.py), the scheduler (scheduler.py), the generation algorithm
(steps.py), a request's generations (turn.py), a round's lanes (lanes.py) and the one loop that runs them
(engine.py: EngineCore.add_request / step / abort)."""

from .engine import EngineCore, batch_size
from .request import Request, as_ids, cache_need, resolve

__all__ = ["EngineCore", "Request", "as_ids", "batch_size", "cache_need", "resolve"]
