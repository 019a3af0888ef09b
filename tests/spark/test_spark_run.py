"""``hora.spark.run`` on one shared ``local-cluster[2,1,1024]`` Spark session (2 executors of 1 core each).

Every job here is a real barrier-mode Spark job whose ranks meet through
hora's rendezvous and gloo; every test has a timeout.
"""

from __future__ import annotations

import io
import re
import time

import numpy as np
import pytest
from conftest import rank_processes, run_raising_job, run_script_job, skip_without_spark

from hora.errors import ConfigError

skip_without_spark()

import hora.spark  # noqa: E402

pytestmark = [pytest.mark.spark]

#: The job's own variables for every rank: a rank waiting on a dead peer gives up soon.
ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "10", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30"}


def _torch_ranks(offset):
    import os

    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    print(f"rank {hvd.rank()} of {hvd.size()} says hello", flush=True)
    return hvd.rank(), hvd.local_rank(), hvd.size(), total, os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.timeout(300)
def test_torch_function_results_come_in_rank_order_with_prefixed_output(spark):
    out, err = io.StringIO(), io.StringIO()
    results = hora.spark.run(_torch_ranks, args=(10,), num_proc=2, env=ENV, stdout=out, stderr=err,
                             prefix_output_with_timestamp=True)
    assert results == [(0, 0, 2, 21.0, None), (1, 1, 2, 21.0, None)]  # one host: local ranks 0 and 1
    lines = out.getvalue().splitlines()
    for rank in (0, 1):
        # "Fri Nov 27 10:00:00 2026[0]<stdout>:rank 0 of 2 says hello"
        expected = rf"\w{{3}} \w{{3}} +\d+ [\d:]{{8}} \d{{4}}\[{rank}\]<stdout>:rank {rank} of 2 says hello"
        assert any(re.fullmatch(expected, line) for line in lines), lines


def _keras_ranks():
    import numpy as np

    import hora.keras as hvd

    hvd.init()
    summed = hvd.allreduce(np.array([hvd.rank() + 1.0], dtype=np.float32), op=hvd.Sum)
    import keras

    return hvd.rank(), keras.backend.backend(), float(np.asarray(summed)[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras3_function(spark):
    results = hora.spark.run(_keras_ranks, num_proc=2, env={**ENV, "KERAS_BACKEND": "torch"})
    assert results == [(0, "torch", 3.0), (1, "torch", 3.0)]


@pytest.mark.timeout(300)
def test_script_path_with_arguments(spark, tmp_path):
    assert run_script_job(tmp_path, env=ENV) == ["2.0 gloo --epochs 3"] * 2


@pytest.mark.timeout(300)
def test_a_raising_rank_cancels_the_job_within_10_s_with_its_traceback(spark):
    error, seconds, out = run_raising_job(ValueError("rank one gives up"), env=ENV)
    assert seconds < 10, out
    assert error.rank == 1 and error.exitcode == 1
    assert "ValueError: rank one gives up" in error.traceback
    assert "one_rank_raises" in error.traceback  # the rank's own frames, not Py4J's
    assert "Py4J" not in str(error) and "ValueError: rank one gives up" in str(error)
    assert isinstance(error.__cause__, ValueError)
    deadline = time.monotonic() + 10
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(), "a rank outlived its cancelled job"


@pytest.mark.timeout(120)
def test_more_ranks_than_slots_fails_in_seconds_naming_both(spark):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"num_proc=3 .* task slots: 2"):
        hora.spark.run(_torch_ranks, args=(0,), num_proc=3)
    assert time.monotonic() - started < 10


@pytest.mark.timeout(180)
def test_a_task_failing_before_its_rank_starts_gives_the_task_python_error(spark):
    # the executors have no such interface: the tasks fail in their set-up, before any rank reports
    from hora.errors import LaunchError

    started = time.monotonic()
    with pytest.raises(LaunchError, match="before any rank reported.*'nosuchnic0' does not exist here"):
        hora.spark.run(_torch_ranks, args=(0,), num_proc=2, nics=["nosuchnic0"])
    assert time.monotonic() - started < 120


def _fails_once(marker):
    import os

    import hora.torch as hvd

    hvd.init()
    if hvd.rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return hvd.rank()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_max_retries_resubmits_the_job(spark, tmp_path):
    assert hora.spark.run(_fails_once, args=(str(tmp_path / "failed"),), num_proc=2, env=ENV,
                          max_retries=1) == [0, 1]


def _train_digits(x_test, y_test, epochs):
    import numpy as np
    import torch

    import hora.spark
    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    part = hora.spark.data()
    seen = np.concatenate([b["id"] for b in part.batches(512, columns=["id"], even=False)])
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = torch.utils.data.DataLoader(part.torch_dataset(batch_size=32, shuffle=True), batch_size=None)
    for epoch in range(epochs):
        loader.dataset.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(batch["features"] / 16.0), batch["label"])
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test) / 16.0).argmax(1).numpy()
    return seen.tolist(), float((predicted == y_test).mean())


@pytest.mark.timeout(400)
def test_df_trains_the_digits_mlp_on_disjoint_halves(spark):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    ids = np.arange(len(y))
    x_train, x_test, y_train, y_test, id_train, _ = train_test_split(x, y, ids, test_size=0.25, random_state=0)
    from pyspark.sql import types

    schema = types.StructType([types.StructField("id", types.LongType()),
                               types.StructField("features", types.ArrayType(types.FloatType())),
                               types.StructField("label", types.LongType())])
    rows = [(int(i), [float(v) for v in f], int(label)) for i, f, label in zip(id_train, x_train, y_train, strict=True)]
    df = spark.createDataFrame(rows, schema)
    results = hora.spark.run(_train_digits, args=(x_test, y_test, 15), num_proc=2, df=df, env=ENV)
    (seen0, accuracy0), (seen1, accuracy1) = results
    assert not set(seen0) & set(seen1), "the ranks' rows overlap"
    assert sorted(seen0 + seen1) == sorted(id_train.tolist())
    assert abs(len(seen0) - len(seen1)) <= 1
    assert accuracy0 == accuracy1 >= 0.95


def _file_share_ids():
    import os

    import hora.spark

    part = hora.spark.data()
    epochs = [np.concatenate([b["id"] for b in part.batches(7, shuffle=True, epoch=e, even=False)]).tolist()
              for e in range(2)]
    widths = {b["x"].shape[1] for b in part.batches(50, columns=["x"])}
    return "HORA_SPARK_FILES" in os.environ, part.columns, epochs, widths


@pytest.mark.timeout(300)
def test_df_of_parquet_files_is_read_by_the_ranks_from_the_files(spark, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from hora.spark.files import scan_files

    ids = np.arange(101)
    x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4)
    table = pa.table({"id": pa.array(ids), "x": x, "extra": pa.array(ids * 2.0)})
    for index, (lo, hi) in enumerate([(0, 30), (30, 31), (31, 101)]):
        pq.write_table(table.slice(lo, hi - lo), str(tmp_path / f"part-{index}.parquet"), row_group_size=16)
    df = spark.read.parquet(str(tmp_path)).select("id", "x")
    assert [n for _, n in scan_files(df)] == [30, 1, 70]
    # anything Spark must compute goes through Spark
    assert scan_files(df.where("id > 3")) is None
    assert scan_files(df.withColumn("y", F.col("id") + 1)) is None
    assert scan_files(df.select(F.col("id").alias("key"))) is None
    results = hora.spark.run(_file_share_ids, num_proc=2, df=df, env=ENV)
    (direct0, columns, (first0, second0), widths), (direct1, _, (first1, second1), _) = results
    assert direct0 and direct1 and columns == ["id", "x"] and widths == {4}
    assert sorted(first0) == sorted(second0) and first0 != second0  # a new shuffle, the same rows
    assert sorted(first1) == sorted(second1)
    assert sorted(first0) == list(range(50)) and sorted(first1) == list(range(50, 101))


@pytest.mark.timeout(120)
def test_an_unsupported_column_is_named_before_the_job_starts(spark):
    df = spark.createDataFrame([(1.0, "a")], "x double, name string")
    with pytest.raises(ConfigError, match="column 'name' has type string"):
        hora.spark.run(_torch_ranks, args=(0,), num_proc=2, df=df)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_mode_delegates_to_hora_run(spark):
    # the ranks run on this machine under hora.run, not in Spark tasks
    results = hora.spark.run(_torch_ranks, args=(0,), num_proc=2, env=ENV, local_mode=True)
    assert [r[:4] for r in results] == [(0, 0, 2, 1.0), (1, 1, 2, 1.0)]

