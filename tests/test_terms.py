"""Every formula memcalc shows computes the value it shows (what --explain prints is checked)."""

import math
import re
from fractions import Fraction

import pytest

from memcalc.cli.groups import ModelOptions
from memcalc.memory.estimate import Setup, estimate
from memcalc.model.flops import flop_terms
from memcalc.model.gpus import gpu
from memcalc.model.layout import Layout
from memcalc.report.explain import explain_lines, symbols
from memcalc.terms import Term


def evaluate(expression: str) -> Fraction:
    """Exact value of a substituted formula: digits with commas, ·, ², /, + and ⌈ ⌉."""
    expr = expression.replace(",", "").replace("·", "*").replace("²", "**2")
    expr = re.sub(r"(\d+)", r"F(\1)", expr).replace("⌈", "ceil(").replace("⌉", ")")
    return eval(expr, {"__builtins__": {}, "F": Fraction, "ceil": math.ceil})  # noqa: S307 - digits and operators


CASES = [
    dict(params="8e9", seq=8192, micro_batch=1, layout=Layout()),
    dict(params="8e9", seq=8192, micro_batch=3, layout=Layout(dp=8, zero=3)),
    dict(model="gpt3-175b", seq=2048, micro_batch=2, layout=Layout(dp=64, zero=1, offload_optimizer=True)),
    dict(model="qwen3-0.6b", seq=1000, micro_batch=5, layout=Layout(dp=3, zero=2)),
]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adam8bit"])
@pytest.mark.parametrize("case", CASES)
def test_every_term_evaluates_to_its_value(case, optimizer):
    model = ModelOptions(params=case.get("params"), model=case.get("model")).resolve()
    setup = Setup(case["seq"], case["micro_batch"], optimizer=optimizer)
    est = estimate(model, setup, gpu("h100-sxm"), layout=case["layout"])
    syms = symbols(est)
    terms = [t for a in est.activations for t in a.terms + a.rebuilt]
    terms += [t for lg in est.logits for t in lg.terms]
    terms += list(flop_terms(model.shape, model.n_params, setup.seq_len))
    terms += [Term(p.name, p.bytes, p.formula, "") for p in est.model_state.parts]
    for t in terms:
        assert evaluate(t.substituted(syms)) == t.value, (t.name, t.substituted(syms))
    assert len(explain_lines(est)) > 30
