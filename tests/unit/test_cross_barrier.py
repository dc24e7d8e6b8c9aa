"""Cross-barrier DistributedOptimizer: the construction-time refusals (one process)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lightcc.common.exceptions import InvalidArgumentError  # noqa: E402
from lightcc.torch import Compression, DistributedOptimizer  # noqa: E402
from lightcc.torch.optimizer.cross_barrier import check_optimizer  # noqa: E402


NONE = Compression.none   # (the default reads LCC_COMPRESSION, which needs init())


def _params():
    return torch.nn.Linear(3, 2).parameters()


@pytest.mark.parametrize("make", [
    lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True),
    lambda: torch.optim.AdamW(_params(), fused=True),
    lambda: torch.optim.Adagrad(_params()),
])
def test_per_parameter_optimizers_are_accepted(make):
    check_optimizer(make())


def test_whole_model_optimizers_and_subclasses_are_refused():
    class Clipping(torch.optim.SGD):
        pass

    for opt in (torch.optim.LBFGS(_params()), Clipping(_params(), lr=0.1)):
        with pytest.raises(InvalidArgumentError, match="per parameter"):
            check_optimizer(opt)


def test_cross_barrier_needs_a_model_and_model_needs_cross_barrier():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="needs model="):
        DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=NONE,
                             cross_barrier=True)
    with pytest.raises(InvalidArgumentError, match="needs model="):
        DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=NONE,
                             cross_barrier=True, model=opt)
    with pytest.raises(InvalidArgumentError, match="only used with cross_barrier=True"):
        DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                             compression=NONE)


@pytest.mark.parametrize("spec,numel,limit,pieces", [
    ("none", 100, 60, 7), ("fp16", 100, 60, 7), ("bf16", 15, 60, 1), ("none", 100, 0, 1),
    ("topk:0.01", 100, 60, 1), ("fp8", 100, 60, 1)])
def test_gradients_are_cut_into_views_only_for_elementwise_compression(spec, numel, limit,
                                                                         pieces):
    """Cross-barrier partitioning: pieces of at most ``limit`` bytes that are views covering
    the gradient exactly once, in order; never for compressors whose result depends on more
    than one element (TopK's k, fp8's scales) or with partitioning off."""
    import types

    import numpy as np

    from lightcc.torch.optimizer.reducer import GradientReducer
    arr = np.arange(numel, dtype=np.float32).reshape(-1, 5)
    got = GradientReducer.pieces(
        types.SimpleNamespace(partition_bytes=limit, spec=spec), arr)
    assert len(got) == pieces
    assert all(np.shares_memory(g, arr) for g in got)
    assert all(g.nbytes <= limit for g in got) or pieces == 1
    np.testing.assert_array_equal(np.concatenate([g.reshape(-1) for g in got]),
                                  np.arange(numel, dtype=np.float32))


def test_a_pending_gradient_says_what_it_knows_without_waiting():
    """PendingGradient (the started reduction the optimizer keeps): ``completed()`` never
    waits and is True only once every piece is done; ``wait_passive()`` is False (nothing
    waited) where only a driving wait can finish it; ``params`` lists a group's members."""
    import types

    from lightcc.torch.optimizer.reducer import PendingGradient, Pieces

    def handle(done, passive=None):
        return types.SimpleNamespace(is_done=done, wait_passive=lambda: passive)

    a, b = torch.zeros(1), torch.zeros(2)
    assert PendingGradient(a, handle(True)).completed()
    assert not PendingGradient(a, handle(False)).completed()
    assert not PendingGradient(a, Pieces([handle(True), handle(False)])).completed()
    assert PendingGradient(a, Pieces([handle(True), handle(True)])).completed()
    assert not PendingGradient(a, lambda: None, sparse=True).completed()
    assert not PendingGradient(a, lambda: None, sparse=True).wait_passive()
    assert not PendingGradient(a, Pieces([handle(True), handle(False, False)])).wait_passive()
    assert PendingGradient(a, Pieces([handle(True), handle(False, True)])).wait_passive()
    assert PendingGradient((a, b), handle(True)).params == (a, b)
    assert PendingGradient(a, handle(True)).params == (a,)
