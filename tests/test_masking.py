"""ncljax.masking: the padded-rows mask and the masked sums, against hand-worked values."""

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import losses, masking


def test_valid_rows_reads_the_mask_or_makes_every_row_real():
    np.testing.assert_array_equal(masking.valid_rows(3, None), [True, True, True])
    np.testing.assert_array_equal(masking.valid_rows(3, [1, 0, 1]), [True, False, True])


@pytest.mark.parametrize("where", [[True, False], [[True, True, False]]])
def test_a_mask_of_the_wrong_shape_is_one_error_naming_it(where):
    with pytest.raises(ValueError, match=r"^where must have shape \(3,\), got"):
        masking.valid_rows(3, where)
    with pytest.raises(ValueError, match=r"^mine must have shape \(3,\)"):
        masking.valid_rows(3, where, name="mine")
    # every pure function of the core reads its mask through it
    with pytest.raises(ValueError, match=r"where must have shape \(3,\)"):
        losses.info_nce(jnp.eye(3), where=jnp.asarray(where))


def test_masked_metric_sums_the_kept_entries_and_counts_them():
    values = jnp.asarray([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    got = masking.masked_metric(values, jnp.asarray([True, False, True]))
    np.testing.assert_allclose(got, [1 + 4 + 8 + 32, 4])
