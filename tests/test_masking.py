"""ncljax.masking: the padded-rows mask and the masked sums, against hand-worked values."""

import jax
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


def test_row_block_divides_the_batch_or_keeps_it_whole():
    assert masking.row_block(1024, 256) == 256
    assert [masking.row_block(n, 256) for n in (256, 128, 1000)] == [256, 128, 1000]
    assert masking.row_block(1024, 0) == masking.row_block(1024, None) == 1024


def test_by_row_blocks_maps_blocks_of_rows_in_order():
    x = jnp.arange(36.0).reshape(6, 6)
    extra = jnp.arange(6.0) * 10
    seen = []

    def fn(block, rows, e):  # each row's sum plus its extra value, and its own entry
        index = jnp.arange(block.shape[0]) if rows is None else rows
        own = jnp.take_along_axis(block, index[:, None], axis=1)[:, 0]
        seen.append(None if rows is None else rows.shape)
        return block.sum(1) + e, own

    for block in (1, 2, 3, 6):  # 6: one call, rows None
        for checkpoint in (False, True):
            got = masking.by_row_blocks(fn, x, block, extra, checkpoint=checkpoint)
            np.testing.assert_allclose(got[0], np.asarray(x).sum(1) + np.asarray(extra))
            np.testing.assert_allclose(got[1], np.diagonal(np.asarray(x)))
    assert (2,) in seen and None in seen


def test_a_block_takes_every_count_th_row():
    got = masking.by_row_blocks(lambda block, rows: rows, jnp.zeros((6, 6)), 2)
    np.testing.assert_array_equal(got, np.arange(6))  # each row's own index, in order
    blocks = []
    masking.by_row_blocks(lambda block, rows: blocks.append(rows) or rows, jnp.zeros((6, 6)), 2)
    assert blocks[0].shape == (2,)  # traced: block j holds rows j and j + 3


def test_row_argmax_matches_numpy():
    """numpy's ``argmax`` over the last axis: ties and NaN to the lowest index, a row of
    ``-inf`` to 0; batched rows and one column."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 4, (9, 6)).astype(np.float32)  # many ties
    values[1] = -np.inf
    values[2, [1, 4]] = np.nan
    values[3, 5] = np.inf
    values[4, 0] = np.nan
    got = jax.jit(masking.row_argmax)(values)
    np.testing.assert_array_equal(got, np.argmax(values, axis=-1))
    assert got.dtype == np.int32
    batched = rng.normal(size=(2, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(masking.row_argmax(batched), np.argmax(batched, axis=-1))
    np.testing.assert_array_equal(masking.row_argmax(np.ones((3, 1), np.float32)), [0, 0, 0])
