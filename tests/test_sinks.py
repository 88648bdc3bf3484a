"""The optional metric sinks against the real services' local stores, in-process (no training run).

TensorBoard events are read back with TensorBoard's own reader, MLflow from a `file:` tracking store
with MlflowClient, W&B from an offline run's .wandb log. `make setup` installs all three packages (the
`test` extra), so nothing here is skipped: a missing package is a failure, not a skip.
"""
from __future__ import annotations

import json
import math
import os
import struct

import pytest

from phalanx.run.sinks import MlflowSink, TensorBoardSink, WandbSink

# What the loop writes: a step, per-rank lists, an event line (never logged), a non-finite value and
# text (both dropped for the scalar-only services).
RECORDS = [{"step": s, "time_s": 0.1 * s, "loss": 3.0 - s / 10, "tokens_per_s": 1000.0 + s,
            "ranks/rss_mb": [100.0 + s, 120.0], "grad_norm": math.nan, "note": "text"} for s in (2, 4, 6)]
EVENT = {"step": 4, "time_s": 0.5, "event": "checkpoint", "path": "checkpoints/step-4"}
EXPECTED = {  # tag -> [(step, value)]
    "loss": [(2, 2.8), (4, 2.6), (6, 2.4)],
    "tokens_per_s": [(2, 1002.0), (4, 1004.0), (6, 1006.0)],
    "ranks/rss_mb/rank0": [(2, 102.0), (4, 104.0), (6, 106.0)],
    "ranks/rss_mb/rank1": [(2, 120.0), (4, 120.0), (6, 120.0)],
}
CONFIG = {"train": {"lr": 0.003, "max_steps": 6}, "model": {"n_layer": 2}}


def feed(sink) -> None:
    for record in RECORDS[:2]:
        sink.write(record)
    sink.write(EVENT)
    sink.write(RECORDS[2])
    sink.close()


@pytest.fixture
def restore_environ():
    """Third-party libraries set environment variables of their own (mlflow: MLFLOW_EXPERIMENT_ID)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_tensorboard_sink_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed(TensorBoardSink(tmp_path / "tensorboard"))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(EXPECTED)  # no grad_norm (NaN), note, time_s or event keys
    for tag, points in EXPECTED.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points]), tag  # float32 on disk


def test_mlflow_sink_file_store_read_back(tmp_path, monkeypatch, restore_environ):
    import mlflow
    import mlflow.tracking.fluent
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # file:///...
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores without it
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)  # set_experiment's global

    sink = MlflowSink("phalanx-test", "run-a", CONFIG)
    run_id = mlflow.active_run().info.run_id
    feed(sink)
    assert mlflow.active_run() is None  # close() ended the run

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert client.get_experiment(run.info.experiment_id).name == "phalanx-test"
    assert run.data.params == {"train.lr": "0.003", "train.max_steps": "6", "model.n_layer": "2"}
    assert set(run.data.metrics) == set(EXPECTED)
    for tag, points in EXPECTED.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
        assert history == points, tag


def test_wandb_sink_offline_run_read_back(tmp_path, monkeypatch, restore_environ):
    import wandb

    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "shakespeare.v2"  # the run folder's name is the W&B id, made id-safe
    run_dir.mkdir()
    try:
        feed(WandbSink("phalanx-test", "run-a", run_dir, CONFIG))
    finally:
        wandb.teardown()  # stop the service process this test started

    logs = list((run_dir / "wandb").glob("offline-run-*-shakespeare-v2/run-shakespeare-v2.wandb"))
    assert len(logs) == 1, list((run_dir / "wandb").rglob("*"))
    records = read_wandb_log(logs[0])

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, run.display_name) == ("shakespeare-v2", "phalanx-test", "run-a")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"] == CONFIG["train"] and config["model"] == CONFIG["model"]

    history = {}  # tag -> [(step, value)]
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for key, value in wandb_items(r.history.item).items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((r.history.step.num, value))
    assert history == EXPECTED
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(wandb_items(r.summary.update))
    assert {k: summary[k] for k in EXPECTED} == {k: points[-1][1] for k, points in EXPECTED.items()}
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # close() finished the run


def read_wandb_log(path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log framed records
    (32 KiB blocks; each chunk: crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
