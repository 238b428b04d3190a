"""PipeDream, Randomized PipeDream and LocalSGD as optimizers on one device (analysis.stale_sgd),
checked against plain SGD where they reduce to it, and against their definitions: the weight
versions each gradient reads, the mean of the workers, and the schedule's clock."""
import numpy as np
import pytest

from jaxpar.analysis import stale_sgd
from jaxpar.parallel.stage import schedules as sc

RNG = np.random.default_rng(0)
A = (lambda q: q @ np.diag(np.linspace(0.2, 1.0, 8)) @ q.T)(np.linalg.qr(RNG.standard_normal((8, 8)))[0])
NOISE = RNG.standard_normal((400, 8))


def quadratic(blocks, i):
    """½ x^T A x with a noisy gradient (sample i's noise): the blocks are x cut into equal parts."""
    x = np.concatenate(blocks)
    g = A @ x + 0.1 * NOISE[i]
    return 0.5 * x @ A @ x, np.split(g, len(blocks))


def sgd(x, steps, lr, start=0):
    for i in range(start, start + steps):
        x = x - lr * np.concatenate(quadratic([x], i)[1])
    return x


X0 = [np.ones(8)]


def test_one_stage_and_one_worker_are_sgd():
    want = sgd(X0[0], 12, 0.3)
    for trajectory in (stale_sgd.pipedream(quadratic, X0, sc.pipedream(1, 12), 0.3),
                       stale_sgd.randomized_pipedream(quadratic, X0, (0,), 12, 0.3),
                       stale_sgd.flushed(quadratic, X0, sc.gpipe(1, 1), 12, 0.3),
                       stale_sgd.local_sgd(quadratic, X0, 1, 3, 4, 0.3)):
        np.testing.assert_allclose(trajectory.blocks[-1][0], want, rtol=1e-12)


def test_local_sgd_merging_every_step_is_sgd_on_the_workers_mean_gradient():
    blocks = np.split(np.ones(8), 4)
    local = stale_sgd.local_sgd(quadratic, blocks, 4, 1, 5, 0.2)
    mean = stale_sgd.flushed(quadratic, blocks, sc.gpipe(4, 4), 5, 0.2)
    np.testing.assert_allclose(np.concatenate(local.blocks[-1]), np.concatenate(mean.blocks[-1]), rtol=1e-12)
    assert local.seconds[-1] == 5 * 4 * 3.0  # a local step: 4 stages' forward (1 s) and backward (2 s) on one device


@pytest.mark.parametrize("stages", [2, 4])
def test_pipedream_reads_each_stage_at_its_stashed_version_and_the_randomized_model_at_its_delay(stages):
    """Each gradient of micro-batch i reads stage s's weights after max(0, i - (S - s - 1)) of its
    updates; the randomized model reads the iterate delays[s] updates old; the stream's clock runs
    at S updates a forward-and-backward once full."""
    m = 3 * stages
    seen = []

    def tagged(blocks, i):  # each block's first entry counts its updates (gradient -1 there, lr 1)
        seen.append([int(round(b[0])) for b in blocks])
        return 0.0, [np.eye(1, len(b), 0)[0] * -1.0 for b in blocks]

    start = [np.zeros(2) for _ in range(stages)]
    run = stale_sgd.pipedream(tagged, start, sc.pipedream(stages, m), 1.0)
    want = [[max(0, i - (stages - s - 1)) for s in range(stages)] for i in range(m)]
    assert seen == want
    steady = np.diff(run.seconds[stages:])
    np.testing.assert_allclose(steady, 3.0)  # one micro-batch through every stage each 1 + 2 s

    seen.clear()
    delays = tuple(range(stages, 0, -1))
    updates = 40
    run = stale_sgd.randomized_pipedream(tagged, start, delays, updates, 1.0, seed=1)
    totals = [sum(b[0] for b in blocks) for blocks in run.blocks]  # updates made by then
    for k, counts in enumerate(seen):  # update k read the iterate of k - delays[s] updates, s the block it stepped
        assert sum(counts) == totals[max(0, k - delays[_drawn(run, k)])]
    np.testing.assert_allclose(run.seconds[-1], updates * 3.0 / stages)


def _drawn(run, k):
    """The block update k stepped."""
    return int(np.argmax([a[0] != b[0] for a, b in zip(run.blocks[k], run.blocks[k + 1])]))

