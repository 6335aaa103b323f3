"""gradwatch.preflight: the seed's cheap checks to run before a long training run.

* :func:`memorization` -- Stage 1: can the model overfit 8-16 examples?
* :func:`wiring` -- Stage 6: BatchNorm and Dropout behave at evaluation.
* :func:`lr_range_test` -- Stage 5: where does the loss blow up as lr grows?

Each works on copies (your model and optimizer are never changed) and returns
a typed result whose ``str()`` reads as a verdict with what to check next.

Example::

    from gradwatch.preflight import lr_range_test, memorization, wiring

    print(memorization(model, loss_fn, (x[:12], y[:12])))
    print(wiring(model, (x[:64], y[:64]), loss_fn))
    print(lr_range_test(model, optimizer, loss_fn, loader, plot="lr_range.png"))
"""

from gradwatch.preflight.lr_range import LRRangeResult, lr_range_test
from gradwatch.preflight.memorization import MemorizationResult, memorization
from gradwatch.preflight.wiring import Finding, WiringReport, wiring

__all__ = [
    "Finding",
    "LRRangeResult",
    "MemorizationResult",
    "WiringReport",
    "lr_range_test",
    "memorization",
    "wiring",
]
