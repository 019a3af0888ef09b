"""The rank-side readers of ``df=``: Arrow batches spilled to a file and read back as NumPy, torch and tf batches.

No Spark here: the files are written with :func:`hora.spark.partition.spill` from
record batches made with pyarrow, as ``mapInArrow`` hands them over.
"""

from __future__ import annotations

import numpy as np
import pytest

from hora.errors import ConfigError, HoraError
from hora.spark.partition import PartitionData, check_schema, spill

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install 'hora[spark]'")

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


def _write(tmp_path, batches, rows_per_rank=None, rank=0) -> PartitionData:
    path = str(tmp_path / "rank-0.arrow")
    rows = spill(iter(batches), path)
    return PartitionData(path, rows_per_rank or [rows], rank)


def _numbers(start: int, count: int, width: int = 3) -> pa.RecordBatch:
    ids = np.arange(start, start + count)
    features = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, width).astype(np.float32)), width)
    return pa.RecordBatch.from_arrays([pa.array(ids), features, pa.array(ids % 2 == 0)],
                                      names=["id", "x", "flag"])


def test_batches_regroup_the_file_batches_in_order(tmp_path):
    part = _write(tmp_path, [_numbers(0, 7), _numbers(7, 5), _numbers(12, 8)])
    batches = list(part.batches(batch_size=6))
    assert [len(b["id"]) for b in batches] == [6, 6, 6, 2]
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(20))
    assert batches[0]["x"].shape == (6, 3) and batches[0]["x"].dtype == np.float32
    assert batches[0]["x"][4].tolist() == [4.0, 4.0, 4.0]
    assert batches[0]["flag"].dtype == bool and batches[0]["flag"][:2].tolist() == [True, False]
    assert part.steps(6) == 4 and part.steps(6, drop_last=True) == 3
    assert [len(b["id"]) for b in part.batches(batch_size=6, drop_last=True)] == [6, 6, 6]
    assert list(part.batches(batch_size=4, columns=["id"]))[0].keys() == {"id"}


def test_even_reads_the_smallest_partition_on_every_rank(tmp_path):
    part = _write(tmp_path, [_numbers(0, 10)], rows_per_rank=[10, 7])
    assert sum(len(b["id"]) for b in part.batches(batch_size=3)) == 7
    assert sum(len(b["id"]) for b in part.batches(batch_size=3, even=False)) == 10
    assert part.steps(3) == 3 and part.steps(3, even=False) == 4


def test_shuffle_changes_with_the_epoch_and_keeps_every_row(tmp_path):
    part = _write(tmp_path, [_numbers(i * 10, 10) for i in range(5)])
    def order(epoch):
        return np.concatenate([b["id"] for b in part.batches(8, shuffle=True, seed=1, epoch=epoch)]).tolist()
    assert sorted(order(0)) == list(range(50))
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0) != list(range(50))


def test_ml_vectors_dense_and_sparse_become_dense_rows(tmp_path):
    vector = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                        ("values", pa.list_(pa.float64()))])
    column = pa.array([
        {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
        {"type": 0, "size": 3, "indices": [2], "values": [5.0]},
    ], type=vector)
    part = _write(tmp_path, [pa.RecordBatch.from_arrays([column], names=["features"])])
    (batch,) = part.batches(batch_size=10)
    assert batch["features"].tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]]


def test_variable_length_arrays_and_nulls_get_an_error_naming_the_column(tmp_path):
    ragged = pa.RecordBatch.from_arrays([pa.array([[1.0], [1.0, 2.0]])], names=["ragged"])
    with pytest.raises(HoraError, match="column 'ragged' holds arrays of different lengths"):
        list(_write(tmp_path, [ragged]).batches(4))
    nulls = pa.RecordBatch.from_arrays([pa.array([1.0, None])], names=["y"])
    with pytest.raises(HoraError, match="column 'y' has 1 null values"):
        list(_write(tmp_path, [nulls]).batches(4))
    with pytest.raises(ConfigError, match="not in the data"):
        list(_write(tmp_path, [_numbers(0, 2)]).batches(4, columns=["nope"]))


def test_unsupported_spark_columns_are_named_before_the_job():
    types = pytest.importorskip("pyspark.sql.types", reason="pyspark is not installed: pip install 'hora[spark]'")
    from pyspark.ml.linalg import VectorUDT

    good = types.StructType([
        types.StructField("a", types.FloatType()), types.StructField("b", types.LongType()),
        types.StructField("c", types.ArrayType(types.DoubleType())), types.StructField("v", VectorUDT()),
    ])
    check_schema(good)
    bad = types.StructType([types.StructField("a", types.FloatType()), types.StructField("name", types.StringType())])
    with pytest.raises(ConfigError, match="column 'name' has type string"):
        check_schema(bad)


def test_empty_partition_reads_as_no_batches(tmp_path):
    part = _write(tmp_path, [])
    assert list(part.batches(4)) == [] and part.num_rows == 0



def _peaks_while_reading(part) -> tuple[int, int, int]:
    """Read every shuffled batch of ``part``: the rows, and the peaks of NumPy's and Arrow's memory meanwhile."""
    import tracemalloc

    tracemalloc.start()
    arrow_peak = rows = 0
    for batch in part.batches(batch_size=100, shuffle=True):
        rows += len(batch["id"])
        arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
    _, numpy_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return rows, numpy_peak, arrow_peak


def test_memory_stays_bounded_by_one_file_batch(tmp_path):
    """50 MB of rows on file; reading them holds about one 1 MB file batch, not the partition."""

    width, per_batch, count = 256, 1024, 50
    one = _numbers(0, per_batch, width)
    part = _write(tmp_path, [one] * count)
    batch_bytes = per_batch * width * 4
    rows, numpy_peak, arrow_peak = _peaks_while_reading(part)
    assert rows == per_batch * count
    assert numpy_peak < 4 * batch_bytes, numpy_peak
    assert arrow_peak < 4 * batch_bytes, arrow_peak


def test_torch_dataset_feeds_a_dataloader(tmp_path):
    torch = pytest.importorskip("torch")
    part = _write(tmp_path, [_numbers(0, 10), _numbers(10, 10)])
    dataset = part.torch_dataset(batch_size=8, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    assert len(dataset) == 3
    first = [b["id"] for b in loader]
    assert all(isinstance(t, torch.Tensor) for t in first)
    assert sorted(torch.cat(first).tolist()) == list(range(20))
    dataset.set_epoch(1)
    assert torch.cat([b["id"] for b in loader]).tolist() != torch.cat(first).tolist()


@pytest.mark.slow
def test_tf_dataset_gives_the_same_rows(tmp_path):
    tf = pytest.importorskip("tensorflow")
    part = _write(tmp_path, [_numbers(0, 10)])
    dataset = part.tf_dataset(batch_size=4)
    ids = [b["id"].numpy() for b in dataset]
    assert [len(i) for i in ids] == [4, 4, 2]
    assert np.concatenate(ids).tolist() == list(range(10))
    assert dataset.element_spec["x"].shape.as_list() == [None, 3]
    assert dataset.element_spec["x"].dtype == tf.float32


def _parquet_files(tmp_path, sizes, group_rows=4, width=3):
    """Parquet files of consecutive ids (and an array column), ``sizes[i]`` rows in file i."""
    import pyarrow.parquet as pq

    files, start = [], 0
    for index, size in enumerate(sizes):
        path = str(tmp_path / f"part-{index}.parquet")
        pq.write_table(pa.Table.from_batches([_numbers(start, size, width)]), path, row_group_size=group_rows)
        files.append((path, size))
        start += size
    return files


def test_split_rows_is_contiguous_and_even():
    from hora.spark.files import split_rows

    assert split_rows(10, 3) == [3, 3, 4]
    assert split_rows(2, 3) == [0, 1, 1]
    assert split_rows(0, 2) == [0, 0]
    for total, ranks in [(1_000_003, 7), (17, 4)]:
        rows = split_rows(total, ranks)
        assert sum(rows) == total and max(rows) - min(rows) <= 1


def test_file_shares_are_disjoint_complete_and_balanced(tmp_path):
    from hora.spark.files import FileShare, split_rows

    files = _parquet_files(tmp_path, [7, 0, 10, 6])  # row groups of 4: shares start and end inside groups
    rows = split_rows(23, 3)
    shares = [FileShare(files, ["id", "x", "flag"], rows, rank) for rank in range(3)]
    seen = [np.concatenate([b["id"] for b in s.batches(batch_size=5, even=False)]).tolist() for s in shares]
    assert seen == [list(range(0, 7)), list(range(7, 15)), list(range(15, 23))]
    assert [s.num_rows for s in shares] == [7, 8, 8]
    (batch,) = shares[1].batches(batch_size=100, columns=["x"], even=False)
    assert batch.keys() == {"x"} and batch["x"].shape == (8, 3) and batch["x"][0].tolist() == [7.0] * 3
    assert sum(len(b["id"]) for b in shares[2].batches(batch_size=3)) == 7  # even: the smallest share's rows
    shuffled = [np.concatenate([b["id"] for b in shares[2].batches(4, shuffle=True, epoch=e, even=False)]).tolist()
                for e in (0, 1)]
    assert sorted(shuffled[0]) == sorted(shuffled[1]) == seen[2] and shuffled[0] != shuffled[1]


def test_a_file_share_the_rank_cannot_open_names_the_file(tmp_path):
    from hora.spark.files import FileShare

    files = _parquet_files(tmp_path, [4])
    missing = str(tmp_path / "gone.parquet")
    share = FileShare([*files, (missing, 4)], ["id"], [4, 4], 1)
    with pytest.raises(HoraError, match="rank 1 cannot read .*gone.parquet.*every executor must see them"):
        list(share.batches(4))
    with pytest.raises(ConfigError, match="not in the data"):
        list(FileShare(files, ["id"], [4], 0).batches(4, columns=["nope"]))


def test_the_rank_finds_its_file_share_in_its_environment(tmp_path, monkeypatch):
    from hora.spark.files import HORA_SPARK_FILES, FileShare, manifest
    from hora.spark.share import data

    files = _parquet_files(tmp_path, [5, 5])
    monkeypatch.setenv(HORA_SPARK_FILES, manifest(files, ["id", "x"], 2))
    monkeypatch.setenv("HORA_RANK", "1")
    share = data()
    assert isinstance(share, FileShare) and share.columns == ["id", "x"]
    assert np.concatenate([b["id"] for b in share.batches(3)]).tolist() == list(range(5, 10))
    assert manifest([("/x" * 60_000, 1)], ["id"], 2) is None  # too long for one environment variable


def test_file_share_memory_stays_bounded_by_one_row_group(tmp_path):
    """50 MB of rows in Parquet row groups of 1 MB; reading them holds a few row groups, not the share."""

    import pyarrow.parquet as pq

    from hora.spark.files import FileShare

    width, group_rows, count = 256, 1024, 50
    table = pa.Table.from_batches([_numbers(0, group_rows, width)] * count)
    path = str(tmp_path / "big.parquet")
    pq.write_table(table, path, row_group_size=group_rows, compression="none")
    del table
    group_bytes = group_rows * width * 4
    share = FileShare([(path, group_rows * count)], ["id", "x", "flag"], [group_rows * count], 0)
    rows, numpy_peak, arrow_peak = _peaks_while_reading(share)
    assert rows == group_rows * count
    assert numpy_peak < 4 * group_bytes, numpy_peak
    assert arrow_peak < 4 * group_bytes, arrow_peak
