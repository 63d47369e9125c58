"""An earlier TRL release's step beside memcalc's replay of it, run in a process whose path puts that release first
(tests/test_dpo_logits.py installs it apart with `pip install --target`; the test extra's trl is 1.16):

    PYTHONPATH=<trl 1.6.0's folder>:. python -m tests.trl_release dpo:1.6:llama:bf16:full [more cases]

each case --rl, the stack's line, a tests/test_stack_hf.py TINY model, a trick set, full, lora or qlora, and
optionally precompute (DPOConfig.precompute_ref_log_probs): it says
which case differs (tests/replay.py assert_watched_cpu: allocation by allocation on CPU tensors under the Trainer's
autocast) and exits 1, else 0."""

from __future__ import annotations

import sys
from dataclasses import replace

from memcalc.model.finetune import Finetune
from memcalc.model.stacks import STACKS, line_of

FINETUNES = {"full": Finetune(), "lora": Finetune(4), "qlora": Finetune(4, quantize="nf4")}


def main(*cases: str) -> int:
    import trl

    from tests.replay import assert_watched_cpu
    from tests.test_stack_hf import TINY

    failed = 0
    for case in cases:
        rl, line, model, tricks, finetune, *precompute = case.split(":")
        if line_of(trl.__version__) != line:
            print(f"trl {trl.__version__} is not a release of the {line} line")
            return 1
        stack = replace(STACKS[f"trl:{line}"], finetune=FINETUNES[finetune], rl=rl, loss="full",
                        precompute_ref=precompute == ["precompute"])  # fmt: skip
        try:
            assert_watched_cpu(TINY[model], stack, tricks)
        except AssertionError as e:
            print(f"trl {trl.__version__}, {case}: the replay differs: {e!r}")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
