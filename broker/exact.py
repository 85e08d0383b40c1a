"""The exact one-pipeline placement, as a MILP solved by HiGHS: a reference for tests and
benchmarks on small instances (imports `highspy`, a development dependency).

    minimize T  subject to  sum_i n_i = L,  n_i <= cap_i * y_i,  x_i * y_i + t_i * n_i <= T,
                            n_i integer >= 0,  y_i in {0, 1}
"""

from __future__ import annotations

from collections.abc import Mapping

from broker.core.placement import PlacementConfig, PlacementError, provider_costs
from dag.cost import HardwareProfile
from dag.model import ModelSpec


def optimal_bottleneck(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> float:
    """The smallest achievable bottleneck (seconds per microbatch) of one pipeline."""
    import highspy

    config = config or PlacementConfig()
    costs = provider_costs(model, providers, config)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-9)
    upper = float(max(costs.x + costs.t * model.n_layers))
    bottleneck = h.addVariable(lb=0.0, ub=upper)
    counts, used = [], []
    for i in range(len(costs.ids)):
        counts.append(h.addVariable(lb=0, ub=int(costs.cap[i]), type=highspy.HighsVarType.kInteger))
        used.append(h.addVariable(lb=0, ub=1, type=highspy.HighsVarType.kInteger))
    h.addConstr(sum(counts) == model.n_layers)
    for i in range(len(costs.ids)):
        h.addConstr(counts[i] - int(costs.cap[i]) * used[i] <= 0)
        h.addConstr(float(costs.x[i]) * used[i] + float(costs.t[i]) * counts[i] - bottleneck <= 0)
    h.minimize(bottleneck)
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise PlacementError(
            f"no exact placement: HiGHS says {h.modelStatusToString(h.getModelStatus())}"
        )
    return float(h.getSolution().col_value[0])
