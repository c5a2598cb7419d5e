"""``TransferPlan`` (invariant 7's last clause): source and destination lists have equal length."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.errors import PlanError
from kvkit.interfaces import TransferPlan, TransferResult

ids = st.lists(st.integers(0, 2**40), max_size=20)


@given(ids, ids, st.sampled_from(["store", "load"]))
def test_a_plan_exists_only_with_equal_lengths(src, dst, direction):
    """Unequal lists raise a PlanError quoting both lengths; equal ones give read-only int64 arrays."""
    if len(src) != len(dst):
        with pytest.raises(PlanError, match=rf"differ in length: {len(src)} != {len(dst)}"):
            TransferPlan(src, dst, direction)
        return
    plan = TransferPlan(src, dst, direction)
    assert len(plan) == len(src) and plan.src.tolist() == src and plan.dst.tolist() == dst
    for arr in (plan.src, plan.dst):
        assert arr.dtype == np.int64 and not arr.flags.writeable


@given(st.lists(st.integers(-(2**40), -1), min_size=1, max_size=5))
def test_negative_ids_are_plan_errors_quoting_them(bad):
    """A negative block id is refused, quoted in the message."""
    with pytest.raises(PlanError, match=rf"non-negative, got \[{bad[0]}"):
        TransferPlan(bad, [0] * len(bad), "load")


@pytest.mark.parametrize("field", ["transfer_id", "worker", "seconds", "num_bytes"])
@pytest.mark.parametrize("bad", [-1, float("nan"), "3"])
def test_a_result_with_a_negative_or_non_numeric_field_is_a_plan_error(field, bad):
    """A worker result with a negative, NaN or non-numeric count raises PlanError quoting it."""
    kwargs = {"transfer_id": 0, field: bad}
    with pytest.raises(PlanError, match=f"TransferResult.{field}={bad!r}: must be an? (int >= 0|number in \\[0)"):
        TransferResult(**kwargs)
