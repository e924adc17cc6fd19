"""Tests for trainer/data/batches.py: every expectation below is worked out by hand in the
comments."""

from __future__ import annotations

import numpy as np
import pytest

from lctrain.recipes.schema import DataConfig
from lctrain.trainer.data.batches import BYTE_EOS, Batch, decode_tokens, encode_text
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.outputs.failures import DataError, explain


def config(source, *, seq_len, batch_size=1, eos_id=None, token_dtype="uint16") -> DataConfig:
    return DataConfig(seq_len=seq_len, batch_size=batch_size, source=str(source),
                      eos_id=eos_id, token_dtype=token_dtype)


def save_npy(path, tokens, dtype=np.int32):
    np.save(path, np.asarray(tokens, dtype=dtype))
    return path


def assert_row(batch: Batch, row: int, *, inputs, targets, positions, segment_ids, loss_mask):
    np.testing.assert_array_equal(batch.inputs[row], inputs)
    np.testing.assert_array_equal(batch.targets[row], targets)
    np.testing.assert_array_equal(batch.positions[row], positions)
    np.testing.assert_array_equal(batch.segment_ids[row], segment_ids)
    np.testing.assert_array_equal(batch.loss_mask[row], loss_mask)


def assert_dtypes(batch: Batch):
    for name in ("inputs", "targets", "positions", "segment_ids"):
        assert getattr(batch, name).dtype == np.int32, name
    assert batch.loss_mask.dtype == np.float32


def assert_batches_equal(a: Batch, b: Batch):
    for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# --------------------------------------------------------------------------------------
# Byte tokenizer
# --------------------------------------------------------------------------------------

def test_encode_text_gives_utf8_bytes():
    ids = encode_text("aé")  # 'a' = 0x61, 'é' = 0xC3 0xA9
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [97, 195, 169])


def test_decode_tokens_drops_eos_and_roundtrips():
    assert decode_tokens([104, 105, BYTE_EOS, 33]) == "hi!"
    assert decode_tokens(encode_text("long ctx ✓")) == "long ctx ✓"


# --------------------------------------------------------------------------------------
# Token files: exact windows
# --------------------------------------------------------------------------------------

def test_single_window_segments_positions_and_mask(tmp_path):
    # 9 tokens, seq_len 8 -> exactly one window, so every row of every batch is this one.
    # eos = 0 at offsets 2, 5 and 6 (6 is an eos-only document).
    # segment of each of the 9 tokens: 1 1 1 | 2 2 2 | 3 | 4 4
    path = save_npy(tmp_path / "t.npy", [5, 6, 0, 7, 8, 0, 0, 9, 1])
    source = make_source(config(path, seq_len=8, batch_size=2, eos_id=0), vocab=10, seed=0)
    batch = source.batch(0)
    assert batch.inputs.shape == (2, 8)
    assert_dtypes(batch)
    for row in range(2):
        assert_row(batch, row,
                   inputs=[5, 6, 0, 7, 8, 0, 0, 9],
                   targets=[6, 0, 7, 8, 0, 0, 9, 1],
                   segment_ids=[1, 1, 1, 2, 2, 2, 3, 4],
                   positions=[0, 1, 2, 0, 1, 2, 0, 0],
                   # 0 where input and target straddle an eos: inputs 2, 5 and 6
                   loss_mask=[1, 1, 0, 1, 1, 0, 0, 1])


def test_window_starting_with_eos(tmp_path):
    # The leading eos ends the previous document (segment 1); the next document starts at 1.
    # segments of the 5 tokens: 1 | 2 2 2 | 3
    path = save_npy(tmp_path / "t.npy", [0, 4, 5, 0, 6])
    batch = make_source(config(path, seq_len=4, eos_id=0), vocab=10, seed=0).batch(0)
    assert_row(batch, 0,
               inputs=[0, 4, 5, 0],
               targets=[4, 5, 0, 6],
               segment_ids=[1, 2, 2, 2],
               positions=[0, 0, 1, 2],
               loss_mask=[0, 1, 1, 0])


def test_no_eos_id_means_one_endless_document(tmp_path):
    # Zeros are ordinary tokens when eos_id is None.
    path = save_npy(tmp_path / "t.npy", [3, 0, 4, 0, 5])
    batch = make_source(config(path, seq_len=4), vocab=10, seed=0).batch(0)
    assert_row(batch, 0,
               inputs=[3, 0, 4, 0],
               targets=[0, 4, 0, 5],
               segment_ids=[1, 1, 1, 1],
               positions=[0, 1, 2, 3],
               loss_mask=[1, 1, 1, 1])


def test_windows_overlap_by_one_token(tmp_path):
    # 9 tokens, seq_len 4 -> (9 - 1) // 4 = 2 windows: tokens[0:5] and tokens[4:9].
    # Window 0 [5 6 0 7 8]: segments 1 1 1 2 2.  Window 1 [8 0 9 1 2]: segments 1 1 2 2 2.
    path = save_npy(tmp_path / "t.npy", [5, 6, 0, 7, 8, 0, 9, 1, 2])
    batch = make_source(config(path, seq_len=4, batch_size=2, eos_id=0), vocab=10, seed=3
                        ).batch(0)
    # One epoch = both windows, in a seeded order; find each by its first token.
    row_of = {int(batch.inputs[r, 0]): r for r in range(2)}
    assert sorted(row_of) == [5, 8]
    assert_row(batch, row_of[5],
               inputs=[5, 6, 0, 7], targets=[6, 0, 7, 8],
               segment_ids=[1, 1, 1, 2], positions=[0, 1, 2, 0], loss_mask=[1, 1, 0, 1])
    assert_row(batch, row_of[8],
               inputs=[8, 0, 9, 1], targets=[0, 9, 1, 2],
               segment_ids=[1, 1, 2, 2], positions=[0, 1, 0, 1], loss_mask=[1, 0, 1, 1])


def test_bin_file_uint16_and_uint32(tmp_path):
    for dtype in ("uint16", "uint32"):
        path = tmp_path / f"t_{dtype}.bin"
        np.array([7, 1, 2, 7, 3], dtype=dtype).tofile(path)
        cfg = config(path, seq_len=4, eos_id=7, token_dtype=dtype)
        batch = make_source(cfg, vocab=8, seed=0).batch(0)
        # segments of [7 1 2 7 3]: 1 | 2 2 2 | 3
        assert_row(batch, 0,
                   inputs=[7, 1, 2, 7], targets=[1, 2, 7, 3],
                   segment_ids=[1, 2, 2, 2], positions=[0, 0, 1, 2], loss_mask=[0, 1, 1, 0])


# --------------------------------------------------------------------------------------
# Token files: epoch order, determinism, resumption, rows=
# --------------------------------------------------------------------------------------

def counting_source(tmp_path, *, batch_size, seed=0):
    """tokens 0..40, seq_len 4 -> 10 windows; window w has inputs 4w..4w+3."""
    path = save_npy(tmp_path / "count.npy", np.arange(41))
    return make_source(config(path, seq_len=4, batch_size=batch_size), vocab=100, seed=seed)


def test_every_window_exactly_once_per_epoch(tmp_path):
    # batch_size 4, 10 windows: batches 0..4 hold samples 0..19 = two epochs; batch 2
    # (samples 8..11) straddles the epoch boundary.
    source = counting_source(tmp_path, batch_size=4)
    batches = [source.batch(i) for i in range(5)]
    inputs = np.concatenate([b.inputs for b in batches])
    targets = np.concatenate([b.targets for b in batches])
    windows = inputs[:, 0] // 4
    np.testing.assert_array_equal(inputs, 4 * windows[:, None] + np.arange(4))
    np.testing.assert_array_equal(targets, inputs + 1)
    for epoch in (windows[:10], windows[10:]):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(10))
    assert not np.array_equal(windows[:10], windows[10:]), "each epoch is reshuffled"
    assert not np.array_equal(windows[:10], np.arange(10)), "order is shuffled"


def test_epoch_order_is_the_documented_permutation(tmp_path):
    # Sample k is window perm_e[k % n] with e = k // n and perm_e from rng([seed, e]).
    # Pinned so that a code change cannot silently change what a resumed run reads.
    seed, n = 5, 10
    source = counting_source(tmp_path, batch_size=4, seed=seed)
    seen = np.concatenate([source.batch(i).inputs[:, 0] // 4 for i in range(5)])
    expected = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in (0, 1)])
    np.testing.assert_array_equal(seen, expected)


def test_resume_reads_what_an_uninterrupted_run_read(tmp_path):
    uninterrupted = counting_source(tmp_path, batch_size=4)
    history = [uninterrupted.batch(i) for i in range(8)]
    resumed = counting_source(tmp_path, batch_size=4)  # fresh object, no state
    for i in (7, 3, 5):
        assert_batches_equal(resumed.batch(i), history[i])


def test_file_rows_equal_slices_of_the_full_batch(tmp_path):
    source = counting_source(tmp_path, batch_size=4)
    full = source.batch(2)  # straddles epochs 0 and 1
    for rows in (slice(0, 2), slice(2, 4), slice(1, None, 2), slice(3, 3)):
        part = source.batch(2, rows=rows)
        assert part.inputs.shape == full.inputs[rows].shape
        for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(getattr(part, name), getattr(full, name)[rows])


def test_seed_changes_the_order(tmp_path):
    a = counting_source(tmp_path, batch_size=10, seed=0).batch(0).inputs[:, 0]
    b = counting_source(tmp_path, batch_size=10, seed=1).batch(0).inputs[:, 0]
    np.testing.assert_array_equal(np.sort(a), np.sort(b))
    assert not np.array_equal(a, b)


# --------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------

def test_text_folder_sorted_recursive_with_eos(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("hi")                  # 104 105
    (docs / "a.txt").write_text("é", encoding="utf-8")  # 195 169 (sorts first)
    (docs / "c.txt").write_text("")                    # empty: no document
    (docs / "sub" / "a.txt").write_text("x")           # 120, found recursively
    (docs / "notes.md").write_text("ignored")
    # stream: 195 169 EOS | 104 105 EOS | 120 EOS  -> 8 tokens, seq_len 7 -> one window
    # segments of the 8 tokens: 1 1 1 | 2 2 2 | 3 3
    batch = make_source(config(docs, seq_len=7), vocab=300, seed=0).batch(0)
    assert_row(batch, 0,
               inputs=[195, 169, 256, 104, 105, 256, 120],
               targets=[169, 256, 104, 105, 256, 120, 256],
               segment_ids=[1, 1, 1, 2, 2, 2, 3],
               positions=[0, 1, 2, 0, 1, 2, 0],
               loss_mask=[1, 1, 0, 1, 1, 0, 1])
    assert decode_tokens(batch.inputs[0]) == "éhix"


def test_single_text_file_any_extension(tmp_path):
    path = tmp_path / "doc.md"
    path.write_bytes(b"ab\r\n")  # bytes as stored: no newline translation
    # stream: 97 98 13 10 EOS -> 5 tokens, seq_len 4
    batch = make_source(config(path, seq_len=4, eos_id=7), vocab=257, seed=0).batch(0)
    # eos_id from the config is ignored for text: only BYTE_EOS ends a document
    assert_row(batch, 0,
               inputs=[97, 98, 13, 10], targets=[98, 13, 10, 256],
               segment_ids=[1, 1, 1, 1], positions=[0, 1, 2, 3], loss_mask=[1, 1, 1, 1])


# --------------------------------------------------------------------------------------
# Synthetic copy task
# --------------------------------------------------------------------------------------

def synthetic(*, seq_len=6, batch_size=4, vocab=50, seed=0):
    return make_source(config("synthetic", seq_len=seq_len, batch_size=batch_size),
                       vocab=vocab, seed=seed)


@pytest.mark.parametrize("seq_len, half", [(6, 4), (7, 4)])
def test_synthetic_second_half_repeats_the_first(seq_len, half):
    # seq has seq_len + 1 tokens; half = ceil((seq_len + 1) / 2): 7 -> 4, 8 -> 4.
    batch = synthetic(seq_len=seq_len).batch(0)
    assert batch.inputs.shape == (4, seq_len)
    assert_dtypes(batch)
    sequence = np.concatenate([batch.inputs, batch.targets[:, -1:]], axis=1)
    np.testing.assert_array_equal(sequence[:, half:], sequence[:, :seq_len + 1 - half])
    np.testing.assert_array_equal(batch.targets, sequence[:, 1:])
    np.testing.assert_array_equal(batch.positions, np.tile(np.arange(seq_len), (4, 1)))
    np.testing.assert_array_equal(batch.segment_ids, np.ones((4, seq_len)))
    np.testing.assert_array_equal(batch.loss_mask, np.ones((4, seq_len)))


def test_synthetic_tokens_come_from_1_to_vocab_minus_1():
    batch = synthetic(seq_len=64, batch_size=8, vocab=3).batch(0)
    assert set(np.unique(batch.inputs)) == {1, 2}


def test_synthetic_is_deterministic_and_varies_with_index_and_seed():
    a, b = synthetic(), synthetic()
    assert_batches_equal(a.batch(5), b.batch(5))
    assert not np.array_equal(a.batch(5).inputs, a.batch(6).inputs)
    assert not np.array_equal(a.batch(5).inputs, synthetic(seed=1).batch(5).inputs)
    rows = a.batch(0).inputs
    assert not np.array_equal(rows[0], rows[1]), "rows differ within a batch"


def test_synthetic_rows_equal_slices_of_the_full_batch():
    source = synthetic(batch_size=6)
    full = source.batch(3)
    for rows in (slice(0, 3), slice(3, 6), slice(1, None, 2)):
        part = source.batch(3, rows=rows)
        for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(getattr(part, name), getattr(full, name)[rows])


# --------------------------------------------------------------------------------------
# Bad data
# --------------------------------------------------------------------------------------

def raises_naming(path, cfg, vocab=10):
    with pytest.raises(DataError) as error:
        make_source(cfg, vocab=vocab, seed=0)
    assert path.name in str(error.value)
    return str(error.value)


def test_bad_data_is_told_in_one_line_as_bad_input(tmp_path):
    """The CLI prints a data error's message alone, with exit 2: input refused before
    anything compiled (trainer/outputs/failures.explain)."""
    with pytest.raises(DataError) as error:
        make_source(config(tmp_path / "nope.bin", seq_len=4), vocab=10, seed=0)
    assert explain(error.value) == (str(error.value), 2) and "nope.bin" in str(error.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.bin"
    raises_naming(path, config(path, seq_len=4))


def test_empty_bin(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert "empty" in raises_naming(path, config(path, seq_len=4))


def test_empty_npy(tmp_path):
    path = save_npy(tmp_path / "empty.npy", [])
    assert "empty" in raises_naming(path, config(path, seq_len=4))


def test_truncated_bin(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02\x00\x03")  # 5 bytes: 2.5 uint16 tokens
    assert "multiple of 2" in raises_naming(path, config(path, seq_len=2))


@pytest.mark.parametrize("array", [np.zeros((2, 3), np.int32), np.zeros(10, np.float32)])
def test_npy_must_be_1d_integer(tmp_path, array):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    assert "1-D integer" in raises_naming(path, config(path, seq_len=4))


def test_corrupt_npy(tmp_path):
    path = tmp_path / "junk.npy"
    path.write_bytes(b"not a numpy file at all")
    raises_naming(path, config(path, seq_len=4))


def test_fewer_than_seq_len_plus_one_tokens(tmp_path):
    path = save_npy(tmp_path / "short.npy", [1, 2, 3, 4])  # 4 < 4 + 1
    assert "4 tokens" in raises_naming(path, config(path, seq_len=4))


def test_eos_id_outside_vocab(tmp_path):
    path = save_npy(tmp_path / "t.npy", [1, 2, 3, 4, 5])
    raises_naming(path, config(path, seq_len=4, eos_id=10), vocab=10)


def test_token_outside_vocab_names_file_and_offset(tmp_path):
    # tokens 0..8 with a 50 at offset 6, seq_len 4: windows start at 0 and 4; only window
    # 1 (tokens 4..8) holds offset 6. The file opens fine: the check happens per batch.
    tokens = np.arange(9)
    tokens[6] = 50
    path = save_npy(tmp_path / "big.npy", tokens)
    source = make_source(config(path, seq_len=4, batch_size=2), vocab=10, seed=0)
    with pytest.raises(DataError) as error:
        source.batch(0)  # one epoch: both windows
    message = str(error.value)
    assert "big.npy" in message and "token 50" in message
    assert "offset 6" in message and "starting at token 4" in message


def test_negative_token(tmp_path):
    path = save_npy(tmp_path / "neg.npy", [1, 2, -1, 3, 4])
    source = make_source(config(path, seq_len=4), vocab=10, seed=0)
    with pytest.raises(DataError, match=r"neg\.npy.*token -1 at token offset 2"):
        source.batch(0)


def test_huge_uint32_token_is_not_wrapped_negative(tmp_path):
    path = tmp_path / "wide.bin"
    np.array([1, 2, 2**31 + 5, 3, 4], np.uint32).tofile(path)
    source = make_source(config(path, seq_len=4, token_dtype="uint32"), vocab=10, seed=0)
    with pytest.raises(DataError, match=f"token {2**31 + 5} at token offset 2"):
        source.batch(0)


def test_text_missing_folder(tmp_path):
    path = tmp_path / "corpus"
    raises_naming(path, config(path, seq_len=4), vocab=257)


def test_text_folder_without_txt_files(tmp_path):
    path = tmp_path / "corpus"
    path.mkdir()
    (path / "readme.md").write_text("not a .txt")
    assert ".txt" in raises_naming(path, config(path, seq_len=4), vocab=257)


def test_text_all_files_empty(tmp_path):
    path = tmp_path / "corpus"
    path.mkdir()
    (path / "a.txt").write_text("")
    (path / "b.txt").write_text("")
    assert "empty" in raises_naming(path, config(path, seq_len=4), vocab=257)


def test_text_needs_vocab_above_byte_eos(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello world")
    raises_naming(path, config(path, seq_len=4), vocab=256)
