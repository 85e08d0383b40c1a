"""The broker's decision core: pure, synchronous, run by the broker service and the simulator.

Pool membership (`pool`), placement (`placement`), re-planning (`replan`), planning several
models over one pool and rebalancing (`planner`), turning desired placements into assign,
promote and unassign messages (`reconcile`), and the job queue (`queue`), behind one entry
point: `Core.handle(event) -> actions` (`core`), with the inputs in `events` and the decisions
in `actions`. Runs can be recorded and replayed (`trace`).

Nothing here imports asyncio, aiohttp, sqlite3 or the p2p layer, reads a clock or draws a
random number: an architecture test enforces the imports, the trace replay the rest.
"""

from broker.core.core import Core
from broker.core.state import CoreConfig, least_loaded

__all__ = ["Core", "CoreConfig", "least_loaded"]
