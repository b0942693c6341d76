"""Ablation reports (`forecast/ablation.py`): verdict rates on synthetic runs whose true parameters are known, seed
pooling, ablation.json's fields and the rendered report.

Each rate test simulates a base and a variant run (`synthetic.simulate_run`: binomial mean@16 on 1,000 prompts plus
an AR(1) drift) for 20 noise seeds and counts the verdicts; the issue asks for real shifts found in >= 80% of the
seeds and identical parameters called `ceiling` or `efficiency` in <= 10%.
"""

import json
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast import design, plots
from megatron_scalerl.forecast.ablation import RULE, SCHEMA, make_ablation
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.predict import ForecastOptions
from megatron_scalerl.forecast.report import ablation_document, dumps, emit
from megatron_scalerl.forecast.synthetic import PaperRun, simulate_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = PaperRun("base", C_mid=2542, B=1.92, A=0.610, budget=16000)  # the paper's 8B run, 81 evaluations to 16k GPU-h
OPTIONS = ForecastOptions(resamples=100, budgets=(16000.0, 50000.0))
NOISE_SEEDS = range(20)


def curve(run: PaperRun, seed: int) -> Curve:
    return simulate_run(run, seed).curve


def verdicts(variant: PaperRun) -> Counter:
    """Verdicts of `variant` against BASE over the noise seeds (base and variant always with different noise)."""
    found = Counter()
    for seed in NOISE_SEEDS:
        ablation = make_ablation([curve(BASE, 1000 + 2 * seed)], [("variant", [curve(variant, 1001 + 2 * seed)])],
                                 OPTIONS)
        found[ablation.contrasts[0].verdict] += 1
    return found


def test_a_shift_is_found_as_a_ceiling():
    found = verdicts(replace(BASE, name="higher", A=BASE.A + 0.05))  # same B and C_mid
    assert found["ceiling"] >= 0.8 * len(NOISE_SEEDS), found


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_c_mid_shift_at_equal_a_is_found_as_efficiency(factor):
    found = verdicts(replace(BASE, name="shifted", C_mid=BASE.C_mid * factor))
    assert found["efficiency"] >= 0.8 * len(NOISE_SEEDS), found


def test_identical_parameters_are_rarely_called_different():
    found = verdicts(replace(BASE, name="same"))
    assert found["ceiling"] + found["efficiency"] <= 0.1 * len(NOISE_SEEDS), found
    assert found["indistinguishable"] >= 0.5 * len(NOISE_SEEDS), found  # equal runs are mostly called equal


def test_a_run_stopped_far_before_its_c_mid_is_rarely_a_ceiling():
    """A variant 4x slower stopped at half its C_mid: its A is an extrapolation. It is too-early (the report then asks
    for runs long enough to bend) or slower in at least 3 of 4 noise seeds; where the point fit and over 80% of its
    refits read a bend in the data (here 1 of 4: 86% of refits), the fit itself is fooled and a ceiling is called, a
    limit of fitting a sigmoid to a run stopped before its inflection."""
    late = replace(BASE, name="late", C_mid=4 * BASE.C_mid, budget=5000)  # stops at half its C_mid
    verdicts = Counter()
    for seed in range(4):
        ablation = make_ablation([curve(BASE, 10 + seed)], [("late", [curve(late, 20 + seed)])], OPTIONS)
        contrast = ablation.contrasts[0]
        verdicts[contrast.verdict] += 1
        if contrast.verdict == "ceiling":
            assert ablation.variants[0].bent_share >= 0.8 and contrast.dA[0] < 0, contrast.reason
            continue
        assert contrast.verdict in ("too-early", "efficiency"), contrast.reason
        if contrast.verdict == "efficiency":
            assert "slower" in contrast.reason and "faster" not in contrast.reason, contrast.reason
            continue
        assert contrast.reason.startswith("late")
        if "has not bent" in contrast.reason:  # then the report asks for longer runs, by how much
            factor = float(re.search(r"late's runs about ([0-9.]+)x as long", contrast.needs).group(1))
            assert 2.0 < factor < 16, contrast.needs  # its true C_mid is 2x its length: ~4x to pass 2x C_mid
    assert verdicts["ceiling"] <= 1, verdicts


DEMO_LIKE = PaperRun("demo", C_mid=0.06, B=2.0, A=0.55, budget=0.3)  # 16 validations to 0.3 GPU-h


def demo_like(run: PaperRun, seed: int, samples: int = 4) -> Curve:
    """A demo-sized run: 16 validations of 64 prompts x `samples` samples, with drift."""
    return simulate_run(run, seed, r0=0.2, num_evals=16, prompts=64, samples_per_prompt=samples, drift_sd=0.01).curve


@pytest.mark.parametrize("change, verdict, at_least", [
    ({}, None, 0), ({"A": DEMO_LIKE.A + 0.08}, "ceiling", 9), ({"A": DEMO_LIKE.A - 0.08}, "ceiling", 8),
    ({"C_mid": 2 * DEMO_LIKE.C_mid}, "efficiency", 7)],
    ids=["identical", "higher-ceiling", "lower-ceiling", "efficiency"])
def test_demo_sized_studies_call_real_shifts_and_rarely_invent_one(change, verdict, at_least):
    """`make ablation`'s design at 2 seeds (16 validations of 64 prompts x 32 samples; it runs 3) on synthetic runs of
    known parameters: a ceiling up 0.08 is called in >= 9 of 10 noise seeds, a ceiling down 0.08 (a smaller gain) in
    >= 8, a C_mid x2 in >= 7, identical runs called different in at most 1, a ceiling shift called `efficiency` in
    at most 1: the verdict reads the compute to each one's own gain; the rule before 2026-11-28 read the compute to
    the base's levels, which a lower ceiling reaches later, and called the ceiling down 0.08 `efficiency` in 3 of 10
    (at 16 samples). Over 30 noise seeds (2026-12-07): at 16 samples the ceiling down 21 `ceiling`, 2 `efficiency`,
    and the C_mid x2 25 `efficiency`; at 32 the ceiling down 27 `ceiling`, none `efficiency`, and the C_mid x2 26
    `efficiency`, 3 `ceiling` (an A known more narrowly shows the fits' A-C_mid trade-off as a ceiling more often)."""
    options = ForecastOptions(resamples=40, budgets=(0.5,), min_compute=0, eval_draws=64 * 32)
    variant = replace(DEMO_LIKE, name="variant", **change)
    found = Counter()
    for trial in range(10):
        study = make_ablation([demo_like(DEMO_LIKE, 1000 + trial, 32), demo_like(DEMO_LIKE, 3000 + trial, 32)],
                              [("variant", [demo_like(variant, 5000 + trial, 32), demo_like(variant, 7000 + trial, 32)])],
                              options, judge_only=True)
        found[study.contrasts[0].verdict] += 1
    if verdict is None:
        assert found["ceiling"] + found["efficiency"] <= 1, found
    else:
        assert found[verdict] >= at_least, found
    if verdict == "ceiling":
        assert found["efficiency"] <= 1, found


def test_a_too_early_verdict_names_a_design_that_calls_it_and_that_design_does():
    """A real ceiling shift (+0.06) on single demo-sized runs of 64 prompts x 4 samples is too early to call; the
    report names the first design its simulated studies call (more samples per validation prompt, more seeds), and
    independent runs of the true curves made with that design are called, mostly a ceiling shift (the simulations
    start from one noisy fit each, so which verdict they reach is theirs; whether one is reached is the claim)."""
    options = ForecastOptions(resamples=60, budgets=(0.5,), min_compute=0, eval_draws=256)
    higher = replace(DEMO_LIKE, name="higher", A=DEMO_LIKE.A + 0.06)
    for trial in range(6):  # the first study whose fits leave a design that calls it (on some, none does)
        contrast = make_ablation([demo_like(DEMO_LIKE, 100 + trial)], [("higher", [demo_like(higher, 200 + trial)])],
                                 options).contrasts[0]
        if contrast.verdict == "too-early" and contrast.needs.startswith("in studies simulated"):
            break
    assert contrast.verdict == "too-early" and contrast.needs.startswith("in studies simulated"), contrast.needs
    seeds, draws = map(int, re.findall(r"(\d+) seeds per recipe and (\d+) completions per validation: [34] of 4",
                                       contrast.needs)[0])
    samples = draws // 64
    called = Counter()
    for trial in range(4):
        study = make_ablation([demo_like(DEMO_LIKE, 1000 + 10 * trial + s, samples) for s in range(seeds)],
                              [("higher", [demo_like(higher, 2000 + 10 * trial + s, samples) for s in range(seeds)])],
                              replace(options, eval_draws=draws), judge_only=True)
        called[study.contrasts[0].verdict] += 1
    assert called["too-early"] <= 1 and called["ceiling"] >= 2, (contrast.needs, called)  # called, mostly right


def test_the_power_of_a_design_is_how_often_its_simulated_studies_reach_each_verdict(tmp_path):
    """`make ablation`'s design (3 seeds, 16 validations of 64 prompts x 32 samples) on synthetic runs: a ceiling down
    0.15 is called a ceiling by most studies simulated from the fits, a C_mid x3 at equal A an efficiency change;
    shares over the verdicts sum to 1, and the report states the power with its number of studies."""
    options = ForecastOptions(resamples=40, budgets=(0.5,), min_compute=0, eval_draws=64 * 32)
    lower = replace(DEMO_LIKE, name="lower", A=DEMO_LIKE.A - 0.15)
    slower = replace(DEMO_LIKE, name="slower", C_mid=3 * DEMO_LIKE.C_mid, budget=0.9)
    study = make_ablation([demo_like(DEMO_LIKE, 40 + s, 32) for s in range(3)],
                          [("lower", [demo_like(lower, 50 + s, 32) for s in range(3)]),
                           ("slower", [demo_like(slower, 60 + s, 32) for s in range(3)])], options, power_trials=6,
                          power_designs=((1, 64),))
    low, slow = (c.power for c in study.contrasts)
    assert sum(low.values()) == pytest.approx(1) and sum(slow.values()) == pytest.approx(1)
    assert low.get("ceiling", 0) >= 4 / 6, low
    assert slow.get("efficiency", 0) >= 4 / 6 and slow.get("ceiling", 0) <= 1 / 6, slow
    data = study.to_dict()
    assert data["options"]["power_trials"] == 6 and data["variants"][0]["power"] == low
    # a study to come of 1 seed and 64 completions per validation: its evaluations' noise hides the ceiling more often
    small = data["variants"][0]["power_designs"]["1x64"]
    assert data["options"]["power_designs"] == ["1x64"] and sum(small.values()) == pytest.approx(1)
    assert small.get("ceiling", 0) < low["ceiling"], (small, low)
    text = ablation_document(study, b"", data).to_markdown(images=False)
    assert "Power of this design: the verdicts of 6 studies of its size" in text
    assert "lower: ceiling " in text, text
    assert ("The same at other designs (seeds per recipe x completions per validation, x the runs' length where it "
            "is not this study's): lower at 1x64: ") in text
    with pytest.raises(UserError, match="must be >= 1 and its length > 0, got 0x64"):
        make_ablation([demo_like(DEMO_LIKE, 40, 16)], [("lower", [demo_like(lower, 50, 16)])], options,
                      power_trials=2, power_designs=((0, 64),))
    assert make_ablation([demo_like(DEMO_LIKE, 40, 16)], [("lower", [demo_like(lower, 50, 16)])],
                         options).contrasts[0].power is None  # not asked for


def test_longer_runs_raise_the_power_to_call_a_barely_bent_efficiency_change(capsys):
    """A C_mid x2.5 at equal A on `make ablation`'s design, its curve barely bent by the runs' end: the study's own
    design calls the efficiency change in few simulated studies, runs twice as long (the fitted curves extrapolated,
    validations at the same spacing: design "3x2048x2") in most, runs 0.6x as long in none; `--power-design` takes
    the length as a third part and refuses a length that is not a positive number."""
    from megatron_scalerl.commands import main

    options = ForecastOptions(resamples=40, budgets=(0.5,), min_compute=0, eval_draws=64 * 32)
    slower = replace(DEMO_LIKE, name="slower", C_mid=2.5 * DEMO_LIKE.C_mid)
    study = make_ablation([demo_like(DEMO_LIKE, 40 + s, 32) for s in range(3)],
                          [("slower", [demo_like(slower, 60 + s, 32) for s in range(3)])], options, power_trials=8,
                          power_designs=((3, 2048, 2.0), (3, 2048, 0.6)))
    own, longer, shorter = (p.get("efficiency", 0) for p in (study.contrasts[0].power,
                                                           *study.contrasts[0].power_designs.values()))
    assert list(study.contrasts[0].power_designs) == ["3x2048x2", "3x2048x0.6"]
    assert shorter < own <= 0.5 < longer, (shorter, own, longer)
    assert study.to_dict()["options"]["power_designs"] == ["3x2048x2", "3x2048x0.6"]
    for bad in ("3x2048x0", "3x2048xlong", "3x2048x1x2", "3", "3x2048xnan"):
        assert main(["sweep", "report", "runs/none", "--power-design", bad]) == 2
        assert f"{bad!r}: expected SEEDSxCOMPLETIONS" in capsys.readouterr().err


def test_each_simulated_seed_drifts_as_its_own_run():
    """The power's simulated seed i drifts as the recipe's run i mod (its runs) did, not as its first run: a recipe
    of a calm run (drift sd 0.002) and a wandering one (0.03) gives simulated seeds that alternate between the two
    (their distance to the mean curve, with evaluation noise made negligible)."""
    options = ForecastOptions(resamples=20, budgets=(0.5,), min_compute=0, eval_draws=64 * 16)
    calm, wandering = (simulate_run(DEMO_LIKE, seed, r0=0.2, num_evals=16, prompts=64, samples_per_prompt=16,
                                    drift_sd=sd).curve for seed, sd in ((10, 0.002), (11, 0.03)))
    recipe = make_ablation([calm, wandering], [("same", [demo_like(DEMO_LIKE, 12, 16)])], options,
                           judge_only=True).base
    rng = np.random.default_rng(0)
    spread = np.mean([[np.sqrt(np.mean((sim.reward - recipe.predict(sim.compute))[1:] ** 2))
                       for sim in design._simulated_recipe(recipe, design.Design(4, 10**7), rng)] for _ in range(10)], axis=0)
    assert max(spread[0], spread[2]) < 0.5 * min(spread[1], spread[3]), spread


def test_one_seed_is_its_own_fit_and_seeds_pool():
    options = replace(OPTIONS, resamples=40)
    single = make_ablation([curve(BASE, 1)], [("same", [curve(BASE, 2)])], options)
    forecast, recipe = single.base.forecasts[0], single.base
    for name in ("A", "B", "C_mid", "R0"):
        assert recipe.fitted[name] == pytest.approx(getattr(forecast.fit, name), rel=1e-9)
    for name in ("A", "B", "C_mid"):
        assert recipe.param_interval(name) == pytest.approx(forecast.param_interval(name), rel=1e-9)
    slow = replace(BASE, name="slow", C_mid=2 * BASE.C_mid)
    pooled = make_ablation([curve(BASE, s) for s in (1, 3, 5)], [("slow", [curve(slow, s) for s in (2, 4)])], options)
    seeds = pooled.base.forecasts
    assert pooled.base.fitted["A"] == pytest.approx(np.mean([f.fit.A for f in seeds]))
    assert min(f.fit.C_mid for f in seeds) <= pooled.base.fitted["C_mid"] <= max(f.fit.C_mid for f in seeds)
    np.testing.assert_allclose(pooled.base.sampled["A"], np.mean([f.boot.A for f in seeds], axis=0))  # draw by draw
    assert len({f.boot.seed for r in (pooled.base, *pooled.variants) for f in r.forecasts}) == 5  # independent
    variant = pooled.to_dict()["variants"][0]
    assert variant["runs"] == ["synthetic:slow:seed2", "synthetic:slow:seed4"] and variant["run"] == variant["runs"][0]
    assert variant["verdict"] == "efficiency"
    assert variant["compute_ratio_50pct_base_gain"] == pytest.approx(2.0, rel=0.15)
    assert variant["compute_ratio_50pct_own_gain"] == pytest.approx(2.0, rel=0.15)  # C_mid x2, A the same


def test_ablation_json_and_report(tmp_path, capsys):
    options = replace(OPTIONS, resamples=40, targets=(0.58,))
    ablation = make_ablation([curve(BASE, 1)], [("higher", [curve(replace(BASE, name="higher", A=0.66), 2)]),
                                                ("slow", [curve(replace(BASE, name="slow", C_mid=5084), 3)])],
                             options, target=0.65)
    data = ablation.to_dict()
    assert data["schema"] == SCHEMA and data["rule"] == RULE and data["curve"] == "val/pass_rate"
    fields = {"name", "run", "runs", "curve", "predictions", "targets", "warnings"}
    fields |= {f"{p}{end}" for p in ("A", "B", "C_mid", "R0") for end in ("", "_lo", "_hi")}
    fields |= {f"compute_to_{pct}pct_base_gain{end}" for pct in (50, 90) for end in ("", "_lo", "_hi")}
    ratios = [f"compute_ratio_{pct}pct_{gain}_gain" for pct in (50, 90) for gain in ("base", "own")]
    comparison = {f"{key}{end}" for key in ("dA", *ratios)
                  for end in ("", "_lo", "_hi")} | {"crossovers", "verdict", "verdict_reason", "needs", "power",
                                                  "power_designs"}
    assert set(data["base"]) == fields
    assert [set(v) for v in data["variants"]] == [fields | comparison] * 2
    higher, slow = data["variants"]
    assert (higher["name"], higher["verdict"], slow["verdict"]) == ("higher", "ceiling", "efficiency")
    assert higher["A_lo"] <= higher["A"] <= higher["A_hi"] and higher["dA_lo"] > 0
    assert [p["gpu_hours"] for p in higher["predictions"]] == [16000.0, 50000.0]
    assert all(p["lo"] <= p["reward"] <= p["hi"] for p in higher["predictions"])
    assert [t["reward"] for t in slow["targets"]] == [0.58, 0.65]
    assert not slow["targets"][1]["reachable"] and slow["targets"][1]["gpu_hours"] == np.inf  # above its ceiling
    line = dumps(data)  # what `--json` prints: one object, inf as null
    parsed = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert "\n" not in line and parsed["variants"][1]["targets"][1]["gpu_hours"] is None

    written = emit(ablation_document(ablation, plots.ablation_png(ablation), data), "ablation.json", data,
                   out=tmp_path / "out", as_json=True)  # as `scalerl sweep report --json --out` does
    assert json.loads(capsys.readouterr().out) == json.loads(line)
    assert sorted(p.name for p in written) == ["ablation.json", "ablation.png", "report.html", "report.md"]
    assert json.loads((tmp_path / "out" / "ablation.json").read_text())["variants"][0]["verdict"] == "ceiling"
    assert (tmp_path / "out" / "ablation.png").read_bytes().startswith(PNG_MAGIC)
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert markdown.startswith("# Ablation: higher, slow vs base-seed1\n")
    assert RULE in markdown and "![ablation.png](ablation.png)" in markdown
    assert "- higher: ceiling: dA = +" in markdown and "| slow |" in markdown
    assert "data:image/png;base64," in (tmp_path / "out" / "report.html").read_text()


def test_bad_input_names_the_problem():
    base, other = curve(BASE, 1), curve(BASE, 2)
    with pytest.raises(UserError, match="bootstrap intervals"):
        make_ablation([base], [("v", [other])], replace(OPTIONS, resamples=0))
    with pytest.raises(UserError, match="v has none"):
        make_ablation([base], [("v", [])], OPTIONS)
    with pytest.raises(UserError, match="given twice: synthetic:base:seed1"):
        make_ablation([base], [("v", [base])], OPTIONS)
    with pytest.raises(UserError, match="names must differ"):
        make_ablation([base], [("v", [other]), ("v", [curve(BASE, 3)])], OPTIONS)
    renamed = Curve("x", "x.jsonl", "val/other", other.compute, other.reward, "given")
    with pytest.raises(UserError, match="one metric"):
        make_ablation([base], [("v", [renamed])], OPTIONS)
    short = Curve.from_arrays(base.compute[:10], base.reward[:10], source="runs/short")
    with pytest.raises(UserError, match="runs/short: only"):  # too few evaluations in the fit window
        make_ablation([base], [("v", [short])], OPTIONS)


def _write_run(run_dir, curves: dict[str, Curve], samples: int) -> None:
    """A run directory whose metrics.jsonl holds `curves` ({metric: curve}, one compute grid) as validations, each
    domain curve with its samples, as the orchestrator logs them."""
    run_dir.mkdir(parents=True)
    grid = next(iter(curves.values())).compute
    rows = [{"role": "orchestrator", "step": i, "gpu_hours": float(c),
             **{m: float(cv.reward[i]) for m, cv in curves.items()},
             **{m.replace("pass_rate", "samples"): float(samples) for m in curves if m != "val/pass_rate"}}
            for i, c in enumerate(grid)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_sweep_report_judges_each_domain_curve_too(tmp_path, capsys):
    from megatron_scalerl.sweep.report import given_runs, report

    code_up = replace(BASE, name="code_up", A=0.70)
    _write_run(tmp_path / "base", {"val/pass_rate": curve(BASE, 1), "val/math/pass_rate": curve(BASE, 2),
                                   "val/code/pass_rate": curve(BASE, 3)}, samples=512)
    _write_run(tmp_path / "variant", {"val/pass_rate": curve(BASE, 4), "val/math/pass_rate": curve(BASE, 5),
                                      "val/code/pass_rate": curve(code_up, 6)}, samples=512)
    written = report(*given_runs([tmp_path / "base", tmp_path / "variant"]), tmp_path / "out", as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert sorted(data["curves"]) == ["val/code", "val/math"]
    code = data["curves"]["val/code"]
    assert code["curve"] == "val/code/pass_rate" and code["options"]["eval_draws"] == 512
    assert code["variants"][0]["name"] == "variant" and code["variants"][0]["verdict"] == "ceiling"
    assert data["curves"]["val/math"]["variants"][0]["verdict"] != "ceiling"
    assert {"ablation_val_code.png", "ablation_val_math.png"} <= {p.name for p in written}
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Domain curve val/code" in markdown and "| variant |" in markdown


def test_runs_that_never_learn_are_too_early_and_say_why():
    """Pass rates of 0 throughout (a sweep's 4-step runs of an untrained model): too-early, not a crash on the base's
    compute to its gain (0 GPU-h), and what it would take says the runs must learn first."""
    def flat(name):
        return Curve.from_arrays(np.linspace(0.001, 0.01, 6), np.zeros(6), name=name, source=name)

    options = ForecastOptions(resamples=20, min_compute=0, eval_draws=16)
    contrast = make_ablation([flat("base")], [("v", [flat("v")])], options).contrasts[0]
    assert contrast.verdict == "too-early" and "shows no gain" in contrast.reason
    assert contrast.needs == "base to learn at all: no study of these runs could compare its gain"
