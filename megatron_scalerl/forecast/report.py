"""Reports: one document rendered to Markdown (report.md, and the terminal) and self-contained HTML (report.html,
PNGs embedded as data URIs), written beside the JSON with every number and the PNG files. All writes are atomic.

Each report opens with a plain-language recommendation.
"""

from __future__ import annotations

import base64
import html
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_scalerl.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text, json_safe
from megatron_scalerl.forecast.ablation import Ablation
from megatron_scalerl.forecast.backtest import Backtest
from megatron_scalerl.forecast.compare import Comparison
from megatron_scalerl.forecast.predict import A_MARGIN, Forecast, format_gpu_hours


@dataclass
class Document:
    """An ordered list of blocks: ("h", level, text), ("p", text), ("list", items), ("table", header, rows),
    ("img", file_name, png_bytes)."""

    title: str
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("h", level, text))

    def paragraph(self, text: str) -> None:
        self.blocks.append(("p", text))

    def items(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("list", items))

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", header, rows))

    def image(self, file_name: str, png: bytes) -> None:
        self.blocks.append(("img", file_name, png))

    def to_markdown(self, images: bool = True) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                out += ["#" * block[1] + " " + block[2], ""]
            elif kind == "p":
                out += [block[1], ""]
            elif kind == "list":
                out += [f"- {item}" for item in block[1]] + [""]
            elif kind == "table":
                out += ["| " + " | ".join(block[1]) + " |", "|" + "---|" * len(block[1])]
                out += ["| " + " | ".join(row) + " |" for row in block[2]] + [""]
            elif kind == "img" and images:
                out += [f"![{block[1]}]({block[1]})", ""]
        return "\n".join(out).rstrip() + "\n"

    def to_html(self) -> str:
        esc = html.escape
        body = [f"<h1>{esc(self.title)}</h1>"]
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                body.append(f"<h{block[1]}>{esc(block[2])}</h{block[1]}>")
            elif kind == "p":
                body.append(f"<p>{esc(block[1])}</p>")
            elif kind == "list":
                body.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in block[1]) + "</ul>")
            elif kind == "table":
                head = "".join(f"<th>{esc(h)}</th>" for h in block[1])
                rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in block[2])
                body.append(f"<table><tr>{head}</tr>{rows}</table>")
            elif kind == "img":
                data = base64.b64encode(block[2]).decode()
                body.append(f'<img alt="{esc(block[1])}" src="data:image/png;base64,{data}">')
        style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;"
                 "color:#222}table{border-collapse:collapse;margin:1rem 0}td,th{border:1px solid #ccc;"
                 "padding:.3rem .6rem;text-align:left}img{max-width:100%}")
        return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{esc(self.title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def emit(document: Document, json_name: str, data: dict, *, out: str | Path | None, as_json: bool = False
         ) -> list[Path]:
    """What every forecasting command does with its result: print it (the markdown without images, or with `as_json`
    one JSON object on stdout) and, with `out`, write it there (`write_report`) and say so (on stderr after JSON, so
    stdout stays one object); returns the paths written."""
    print(dumps(data) if as_json else document.to_markdown(images=False), end="\n" if as_json else "", flush=True)
    if out is None:
        return []
    written = write_report(out, document, json_name, data)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr if as_json else sys.stdout, flush=True)
    return written


def write_report(out_dir: str | Path, document: Document, json_name: str, data: dict) -> list[Path]:
    """Write `json_name`, report.md, report.html and the document's PNGs into `out_dir`; returns the paths."""
    out_dir = Path(out_dir)
    written = [out_dir / json_name, out_dir / "report.md", out_dir / "report.html"]
    atomic_write_json(written[0], json_safe(data))
    atomic_write_text(written[1], document.to_markdown())
    atomic_write_text(written[2], document.to_html())
    for block in document.blocks:
        if block[0] == "img":
            atomic_write_bytes(out_dir / block[1], block[2])
            written.append(out_dir / block[1])
    return written


def dumps(data: dict) -> str:
    """One-line JSON of a report's data, for `--json`."""
    return json.dumps(json_safe(data))


# ---------------------------------------------------------------- the four reports


def _gpu_hours_cell(value: float) -> str:
    """GPU-hours in a table: whole hours from 100 up (16,000), else `format_gpu_hours`'s three significant digits (a
    CPU run's 0.0288 must not read 0)."""
    return f"{value:,.0f}" if abs(value) >= 100 else format_gpu_hours(value)


def _interval(pair, fmt: Callable[[float], str] = "{:.4g}".format) -> str:
    """'[lo, hi]'; a missing or infinite end (a target never reached) reads 'never'; no interval reads '-'."""
    if pair is None:
        return "-"
    return "[" + ", ".join("never" if v is None or not math.isfinite(v) else fmt(v) for v in pair) + "]"


def _fit_section(doc: Document, forecast: Forecast) -> None:
    fit, level = forecast.fit, forecast.options.level
    doc.heading("Fit")
    doc.paragraph(f"R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), fitted by `{fit.method}` to "
                  f"{int(forecast.in_fit.sum())} of {forecast.curve.compute.size} evaluations between "
                  f"{format_gpu_hours(forecast.curve.compute[forecast.in_fit][0])} and "
                  f"{format_gpu_hours(forecast.fitted_until)} GPU-h (rmse {fit.rmse:.4f}).")
    r0_note = "given" if forecast.options.r0 is not None else "first evaluation"
    doc.table(["parameter", "value", f"{level:.0%} interval", "note"], [
        ["A (ceiling)", f"{fit.A:.4f}", _interval(forecast.param_interval("A")),
         f"paper margin +-{A_MARGIN}: [{fit.A - A_MARGIN:.3f}, {fit.A + A_MARGIN:.3f}]"],
        ["B (exponent)", f"{fit.B:.3f}", _interval(forecast.param_interval("B")), ""],
        ["C_mid (GPU-h)", _gpu_hours_cell(fit.C_mid), _interval(forecast.param_interval("C_mid"), _gpu_hours_cell), "half of the gain"],
        ["R0", f"{fit.R0:.4f}", _interval(forecast.param_interval("R0")), r0_note]])
    if forecast.boot is not None:
        noise = forecast.boot.noise.summary()
        source = "estimated" if forecast.options.eval_draws is None else f"from --eval-draws {forecast.options.eval_draws}"
        doc.paragraph(f"Intervals: {forecast.boot.resamples} bootstrap refits under the run's noise model (medians of "
                      f"its draws): drift sd {noise['drift_sd']:.4f}, correlated {noise['drift_corr']:.2f} between "
                      f"evaluations {format_gpu_hours(noise['spacing_gpu_hours'])} GPU-h apart; evaluation noise sd "
                      f"{noise['eval_sd']:.4f} ({source}). Predicted rewards cover the run's own pass rate, drift "
                      "included.")
    if forecast.warnings:
        doc.heading("Warnings", 3)
        doc.items(list(forecast.warnings))


def forecast_document(forecast: Forecast, png: bytes) -> Document:
    doc = Document(f"Forecast: {forecast.curve.name}")
    doc.paragraph("Recommendation: " + forecast.recommendation())
    doc.image("forecast.png", png)
    _fit_section(doc, forecast)
    doc.heading("Predictions")
    doc.table(["GPU-hours", "reward", f"{forecast.options.level:.0%} interval"],
              [[_gpu_hours_cell(p["gpu_hours"]), f"{p['reward']:.4f}", _interval(_pair(p))] for p in forecast.predictions()])
    targets = forecast.targets()
    if targets:
        doc.table(["target reward", "GPU-hours needed", "interval"],
                  [[f"{t['reward']:.3f}", _gpu_hours_cell(t["gpu_hours"]) if t["reachable"] else "never (above A)",
                    _interval(_pair(t), _gpu_hours_cell)] for t in targets])
    now = forecast.current()
    doc.heading("Where the run is now")
    gain = now["fraction_of_gain"]
    doc.items([f"at {_gpu_hours_cell(now['gpu_hours'])} GPU-h: observed {now['observed']:.4f}, fitted {now['fitted']:.4f}",
               f"marginal gain: {now['marginal_gain_per_1k_gpu_hours']:.5f} per 1k GPU-h "
               f"{_interval(now['marginal_gain_interval'])}",
               f"fraction of the asymptote reached (R / A): {now['fraction_of_asymptote']:.1%}",
               "fraction of the attainable gain reached ((R - R0) / (A - R0)): "
               + ("-" if gain is None else f"{gain:.1%}")])
    doc.heading("Power law, same window")
    power = forecast.power
    doc.paragraph(f"R = A - D / C^B with A = {power.A:.4f}, B = {power.B:.3f}, D = {power.D:.4g} "
                  f"(rmse {power.rmse:.4f}). {forecast.power_law_note()}")
    doc.heading("Data")
    doc.items([f"source: {forecast.curve.source}", f"metric: {forecast.curve.metric}",
               f"compute (GPU-hours): {forecast.curve.compute_rule}"])
    return doc


def compare_document(comparison: Comparison, curves_png: bytes, linearised_png: bytes) -> Document:
    doc = Document("Forecast comparison: " + " vs ".join(comparison.names))
    doc.paragraph("Recommendation: " + comparison.recommendation())
    doc.image("compare.png", curves_png)
    level = comparison.forecasts[0].options.level
    doc.heading("Fits")
    doc.table(["run", "A", f"A {level:.0%}", "B", f"B {level:.0%}", "C_mid (GPU-h)", f"C_mid {level:.0%}", "R0"],
              [[f.curve.name, f"{f.fit.A:.4f}", _interval(f.param_interval("A")), f"{f.fit.B:.3f}",
                _interval(f.param_interval("B")), _gpu_hours_cell(f.fit.C_mid), _interval(f.param_interval("C_mid"), _gpu_hours_cell),
                f"{f.fit.R0:.3f}"] for f in comparison.forecasts])
    doc.heading("Who is ahead")
    doc.table(["GPU-hours", "leader", "clear lead"] + comparison.names,
              [[_gpu_hours_cell(row["gpu_hours"]), row["leader"], "yes" if row["clear"] else "within intervals"]
               + [f"{row['rewards'][n]['reward']:.4f}" for n in comparison.names] for row in comparison.budgets])
    doc.heading("Pairs")
    lines = []
    for pair in comparison.pairs:
        a, b = pair["runs"]
        cross = ", ".join(_gpu_hours_cell(c) for c in pair["crossovers"])
        line = (f"{a} vs {b}: A differs by {pair['A_difference']:+.4f}; "
                + (f"the curves cross at {cross} GPU-h" if cross else "the curves do not cross"))
        if pair["shared_A"]:
            s = pair["shared_A"]
            line += (f"; A within +-{A_MARGIN}, refit with shared A = {s['A']:.4f}: B {s['B'][a]:.3f} vs "
                     f"{s['B'][b]:.3f}, {s['more_efficient']} is more compute-efficient")
        lines.append(line)
    doc.items(lines)
    doc.heading("Linearised view")
    doc.paragraph("log F(R) against log C with F(R) = C_mid^B / ((A - R0) / (R - R0) - 1): a line of slope B.")
    doc.image("linearised.png", linearised_png)
    warnings = [f"{f.curve.name}: {w}" for f in comparison.forecasts for w in f.warnings]
    if warnings:
        doc.heading("Warnings")
        doc.items(warnings)
    return doc


def backtest_document(backtest: Backtest, png: bytes) -> Document:
    forecast = backtest.forecast
    doc = Document(f"Backtest: {forecast.curve.name}")
    doc.paragraph(backtest.verdict())
    doc.image("backtest.png", png)
    _fit_section(doc, forecast)
    doc.heading("Held-out evaluations")
    data = backtest.to_dict()["points"]
    doc.table(["GPU-hours", "observed", "predicted", "error", f"{forecast.options.level:.0%} prediction interval"],
              [[_gpu_hours_cell(p["gpu_hours"]), f"{p['observed']:.4f}", f"{p['predicted']:.4f}", f"{p['error']:+.4f}",
                _interval(_pair(p))] for p in data])
    return doc


def ablation_data(ablation: Ablation, left_out: list[dict] | None = None, warnings: list[str] | None = None,
                  curves: dict[str, Ablation] | None = None, backtests: list[dict] | None = None) -> dict:
    """ablation.json's content: `Ablation.to_dict()`, with `left_out` (the runs kept out of the ablation, each
    {"variant", "run", "reason"}) when given, `warnings` (the report's own, beside each recipe's) when given,
    `curves`: {curve: its own ablation's to_dict()} for each further curve (a domain's `val/<domain>`) when given, and
    `backtests`: each run's forecast backtest ({"variant", "run"} and `Backtest.summary()`, or "error") when given."""
    data = ablation.to_dict()
    if backtests is not None:
        data["backtests"] = backtests
    if left_out is not None:
        data["left_out"] = left_out
    if warnings is not None:
        data["warnings"] = warnings
    if curves:
        data["curves"] = {curve: domain.to_dict() for curve, domain in curves.items()}
    return data


def ablation_document(ablation: Ablation, png: bytes, data: dict | None = None,
                      pngs: dict[str, bytes] | None = None) -> Document:
    """The ablation report: verdicts, the figure, each recipe's fit, the differences to the base, the rule, the runs
    left out and the warnings, then one section per domain curve in `data["curves"]` (its figure in `pngs`).
    `data`: the ablation's `ablation_data` when the caller has it (default: its `to_dict()`)."""
    pngs = pngs or {}
    data = ablation.to_dict() if data is None else data
    base, variants, level = data["base"], data["variants"], f"{data['level']:.0%}"
    doc = Document(f"Ablation: {', '.join(v['name'] for v in variants)} vs {base['name']}")
    doc.paragraph(f"Verdicts against the base {base['name']}: "
                  + "; ".join(f"{v['name']}: {v['verdict']}" for v in variants) + ".")
    doc.items([f"{v['name']}: {v['verdict']}: {v['verdict_reason']}"
               + (f". To call it: {v['needs']}" if v.get("needs") else "") for v in variants])
    powered = [v for v in variants if v.get("power")]
    if powered:
        doc.paragraph(f"Power of this design: the verdicts of {data['options']['power_trials']} studies of its size "
                      "(its seeds, its completions per validation) simulated from these fits, their difference taken "
                      "as real: " + "; ".join(f"{v['name']}: " + ", ".join(f"{verdict} {share:.0%}" for verdict, share
                                                                            in v["power"].items()) for v in powered)
                      + ".")
        designs = data["options"].get("power_designs") or []
        if designs:
            doc.paragraph("The same at other designs (seeds per recipe x completions per validation, x the runs' length "
                          "where it is not this study's): " + "; ".join(
                f"{v['name']} at {d}: " + ", ".join(f"{verdict} {share:.0%}" for verdict, share
                                                    in v["power_designs"][d].items())
                for v in powered for d in designs) + ".")
    if data.get("backtests"):
        _backtests_section(doc, data["backtests"])
    doc.image("ablation.png", png)
    doc.heading("Fits")
    doc.paragraph(f"{data['curve']} against GPU-hours; a recipe with several seeds is the mean of their fitted curves "
                  f"(A, R0: the seeds' means; C_mid: where the mean curve reaches half its gain; B: ln 81 / ln(C_90 / "
                  f"C_10)). Intervals: {level}, {data['options']['resamples']} bootstrap refits per run.")
    doc.table(["recipe", "runs", "A", f"A {level}", "B", f"B {level}", "C_mid (GPU-h)", f"C_mid {level}", "R0"],
              [[r["name"], str(len(r["runs"])), f"{r['A']:.4f}", _interval((r["A_lo"], r["A_hi"])), f"{r['B']:.3f}",
                _interval((r["B_lo"], r["B_hi"])), _gpu_hours_cell(r["C_mid"]),
                _interval((r["C_mid_lo"], r["C_mid_hi"]), _gpu_hours_cell), f"{r['R0']:.3f}"]
               for r in (base, *variants)])
    doc.heading("Differences to the base")
    doc.paragraph("Compute ratios (variant / base): to 50% and 90% of the base's gain (when the variant reaches the "
                  "base's levels: a lower ceiling reaches them later) and to 50% and 90% of each one's own gain (the "
                  "paper's efficiency, C_mid and B, free of the ceiling: what the verdict's efficiency reads).")
    rows, header = [], ["variant", "dA", f"dA {level}"]
    for pct in (50, 90):
        header += [f"GPU-h to {pct}% of base gain", f"{level}", "x base", f"{level}"]
    header += [f"own {pct}% x base [{level}]" for pct in (50, 90)]
    for v in variants:
        row = [v["name"], f"{v['dA']:+.4f}", _interval((v["dA_lo"], v["dA_hi"]), "{:+.4f}".format)]
        for pct in (50, 90):
            key = f"compute_to_{pct}pct_base_gain"
            ratio = f"compute_ratio_{pct}pct_base_gain"
            row += [_compute_cell(v[key]), _interval((v[f"{key}_lo"], v[f"{key}_hi"]), _gpu_hours_cell),
                    _ratio_cell(v[ratio]), _interval((v[f"{ratio}_lo"], v[f"{ratio}_hi"]), "{:.2f}".format)]
        for pct in (50, 90):
            own = f"compute_ratio_{pct}pct_own_gain"
            row.append(f"{_ratio_cell(v[own])} {_interval((v[f'{own}_lo'], v[f'{own}_hi']), '{:.2f}'.format)}")
        rows.append(row)
    doc.table(header + ["verdict"], [row + [v["verdict"]] for row, v in zip(rows, variants, strict=True)])
    doc.paragraph(f"The base needs {_compute_cell(base['compute_to_50pct_base_gain'])} GPU-h to reach 50% of its gain "
                  f"and {_compute_cell(base['compute_to_90pct_base_gain'])} GPU-h to reach 90%. "
                  + "; ".join(f"{v['name']} crosses the base at {', '.join(map(_gpu_hours_cell, v['crossovers']))} "
                              "GPU-h" if v["crossovers"] else f"{v['name']} does not cross the base before the "
                              "largest budget" for v in variants) + ".")
    doc.heading("Verdict rule")
    doc.paragraph(data["rule"])
    doc.paragraph(f"The bootstrap models the noise inside each run (its drift and evaluation noise); the paper's "
                  f"+-{A_MARGIN} on A, measured across identical runs, is the floor for a ceiling shift.")
    doc.heading("Budgets and targets")
    recipes = (base, *variants)
    doc.table(["GPU-hours"] + [r["name"] for r in recipes],
              [[_gpu_hours_cell(p["gpu_hours"])] + [f"{r['predictions'][i]['reward']:.4f} "
                                                   f"{_interval(_pair(r['predictions'][i]))}" for r in recipes]
               for i, p in enumerate(base["predictions"])])
    if base["targets"]:
        doc.table(["target reward"] + [f"{r['name']}: GPU-h needed" for r in recipes],
                  [[f"{t['reward']:.3f}"] + [f"{_compute_cell(r['targets'][i]['gpu_hours'])} "
                                             f"{_interval(_pair(r['targets'][i]), _gpu_hours_cell)}" for r in recipes]
                   for i, t in enumerate(base["targets"])])
    doc.heading("Runs")
    doc.items([f"{r['name']}: {', '.join(r['runs'])}" for r in recipes])
    if data.get("left_out"):
        doc.heading("Left out")
        doc.items([f"{e['variant']}: {e['run']}: {e['reason']}" for e in data["left_out"]])
    warnings = [*data.get("warnings", []), *(w for r in recipes for w in r["warnings"])]
    if warnings:
        doc.heading("Warnings")
        doc.items(warnings)
    for curve, domain in data.get("curves", {}).items():
        _domain_section(doc, curve, domain, pngs.get(curve, b""))
    return doc


def _backtests_section(doc: Document, backtests: list[dict]) -> None:
    """How well each run's first half forecast its second (`scalerl forecast backtest RUN --fit-until HALF`)."""
    doc.heading("Forecast backtests")
    doc.paragraph("Each run's curve fitted up to half its GPU-hours, the fit's prediction of the later validations "
                  "scored (errors: predicted - observed pass rate; coverage: the share of later validations inside "
                  "their prediction interval).")
    doc.table(["recipe", "run", "fit until (GPU-h)", "held out", "mean |error|", "max |error|", "final error",
               "coverage"],
              [[b["variant"], b["run"], _gpu_hours_cell(b["fit_until"])] + (
                  [str(b["held_out_points"]), f"{b['mean_abs_error']:.4f}", f"{b['max_abs_error']:.4f}",
                   f"{b['final_error']:+.4f}", "-" if b["coverage"] is None else
                   f"{b['coverage']:.0%} of {b['level']:.0%}"] if "error" not in b else [b["error"], "", "", "", ""])
               for b in backtests])


def _domain_section(doc: Document, curve: str, data: dict, png: bytes) -> None:
    """One domain's ablation (`data`: its ablation_data) as a section: verdicts, figure, fits."""
    level = f"{data['level']:.0%}"
    doc.heading(f"Domain curve {curve}")
    doc.paragraph(f"{data['curve']} against GPU-hours, fitted and judged as above, its evaluation noise that of the "
                  f"domain's own {data['options']['eval_draws'] or 0} completions per validation.")
    doc.image(f"ablation_{curve.replace('/', '_')}.png", png)
    doc.table(["recipe", "A", f"A {level}", "B", "C_mid (GPU-h)", "dA", f"dA {level}", "verdict"],
              [[r["name"], f"{r['A']:.4f}", _interval((r["A_lo"], r["A_hi"])), f"{r['B']:.3f}",
                _gpu_hours_cell(r["C_mid"])] + ([f"{r['dA']:+.4f}", _interval((r["dA_lo"], r["dA_hi"]), "{:+.4f}".format),
                                                 r["verdict"]] if "verdict" in r else ["", "", "base"])
               for r in (data["base"], *data["variants"])])


def _compute_cell(value: float) -> str:
    """GPU-hours that may be inf (never reached)."""
    return _gpu_hours_cell(value) if math.isfinite(value) else "never"


def _ratio_cell(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "never" if value > 0 else "-"


def _pair(row: dict):
    return None if row.get("lo") is None and row.get("hi") is None else (row.get("lo"), row.get("hi"))
