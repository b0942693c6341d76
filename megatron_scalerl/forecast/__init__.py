"""Forecaster: the paper's sigmoidal compute-performance fits of RL runs (pure numpy/scipy, nothing distributed).

    from megatron_scalerl.forecast import ForecastOptions, load_curve, make_forecast
    forecast = make_forecast(load_curve("runs/my_run"), ForecastOptions(budgets=(50_000,)))
    forecast.fit.A, forecast.predictions(), forecast.recommendation()

Modules: data (load and check curves), sigmoid (the law and its fits), powerlaw, uncertainty (bootstrap), predict
(one run's forecast), compare, backtest, synthetic (curves from the paper's parameters), plots, report. The
command, `scalerl forecast`, is `megatron_scalerl.commands.forecast`.
"""

from megatron_scalerl.forecast.backtest import Backtest, run_backtest
from megatron_scalerl.forecast.compare import Comparison, compare_runs
from megatron_scalerl.forecast.data import Curve, load_curve
from megatron_scalerl.forecast.powerlaw import PowerLawFit, fit_power_law
from megatron_scalerl.forecast.predict import Forecast, ForecastOptions, make_forecast
from megatron_scalerl.forecast.sigmoid import SigmoidFit, fit_sigmoid, reward_at

__all__ = [
    "Backtest", "Comparison", "Curve", "Forecast", "ForecastOptions", "PowerLawFit", "SigmoidFit", "compare_runs",
    "fit_power_law", "fit_sigmoid", "load_curve", "make_forecast", "reward_at", "run_backtest",
]
