import pytest

from components.scheduler.cost_model import StepCostModel


def test_learns_a_linear_cost_exactly():
    m = StepCostModel()
    assert m.predict(10, 100, 1) == 0.0
    truth = lambda t, c, s: 0.005 + 0.0004 * t + 0.00001 * c + 0.0002 * s  # noqa: E731
    shapes = [(t, c, s) for t in (1, 8, 64, 256) for c in (16, 300, 2000) for s in (1, 4, 16)]
    for t, c, s in shapes:
        m.observe(t, c, s, truth(t, c, s))
    assert m.predict(128, 1000, 8) == pytest.approx(truth(128, 1000, 8), rel=1e-6)


def test_few_samples_use_time_per_token():
    m = StepCostModel(min_samples=8)
    m.observe(100, 0, 1, 0.2)
    assert m.predict(50, 0, 1) == pytest.approx(0.1)
