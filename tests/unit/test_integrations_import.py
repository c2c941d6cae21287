"""``oldlogit.integrations`` imports no framework (nor torch) until a name needs it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_integrations_imports_no_framework() -> None:
    code = (
        "import sys, oldlogit.integrations, oldlogit.integrations.padded, "
        "oldlogit.integrations.verl; "
        "from oldlogit.integrations import PaddedLogprobs, compute_old_log_prob; "
        "bad = [m for m in ('torch', 'trl', 'transformers', 'verl') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_trl_integration_is_a_grpo_trainer() -> None:
    import trl

    from oldlogit.integrations import OldLogitGRPOTrainer

    assert issubclass(OldLogitGRPOTrainer, trl.GRPOTrainer)
