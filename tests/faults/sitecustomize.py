"""Test-only fault injection for training ranks; nothing of it lives in the library.

A test puts this folder first on ``PYTHONPATH``: every Python process it starts then imports
this module at start-up. In the rank whose ``RANK`` is ``DOMINO_TEST_FAIL_RANK``, the step loop's
learning-rate lookup (the first thing each step does) raises at step ``DOMINO_TEST_FAIL_STEP``
(default 1), as a crash there would. Any other process is left alone.
"""

import os

_RANK = os.environ.get("DOMINO_TEST_FAIL_RANK")

if _RANK is not None and os.environ.get("RANK") == _RANK:
    from domino.training import loop

    _STEP = int(os.environ.get("DOMINO_TEST_FAIL_STEP", "1"))
    _learning_rate = loop.learning_rate

    def _failing_learning_rate(step, args):
        if step == _STEP:
            raise RuntimeError(f"injected failure on rank {_RANK} at step {step} "
                               "(DOMINO_TEST_FAIL_RANK)")
        return _learning_rate(step, args)

    loop.learning_rate = _failing_learning_rate
