"""`ctrflow train --config FILE|PRESET`: files and presets, flags over them, `--print-config` round trips,
one-line errors naming the key and the file, a flag for every config field, and files written before
models owned their settings."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ctrflow.cli import main
from ctrflow.commands.train import all_flags
from ctrflow.config import ModelConfig, TrainConfig, criteo_1tb_config
from ctrflow.config.files import load_config, preset_names, read_config
from ctrflow.config.tree import section_types
from ctrflow.errors import UserError
from ctrflow.models.dcnv2 import DCNv2Config


def printed_config(capsys, *argv: str) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_print_config_fed_back_gives_the_same_config(tmp_path, capsys):
    first = printed_config(capsys, "--config", "mlperf-dlrm", "--data", "d", "--out", "o", "--model", "dcnv2",
                           "--deep-mlp", "512,256,128", "--cross-rank", "64", "--dropout", "0.25",
                           "--decay-start-step", "none", "--decay-start-epoch", "none", "--no-shuffle", "--sparse-lr", "0.5", "--overwrite")
    (tmp_path / "run.yaml").write_text(first)
    again = printed_config(capsys, "--config", str(tmp_path / "run.yaml"))
    assert again == first
    config = load_config(str(tmp_path / "run.yaml"))
    assert config.model == ModelConfig(name="dcnv2", embedding_dim=128, dropout=0.25, embedding_init_scale=1.0,
                                       arch=DCNv2Config(bottom_mlp=(512, 256), deep_mlp=(512, 256, 128),
                                                        cross_layers=3, cross_rank=64))
    assert (config.optim.decay_start_step, config.optim.decay_start_epoch, config.optim.sparse_lr,
            config.data.shuffle, config.overwrite) == (None, None, 0.5, False, True)
    assert "deep_mlp: [512, 256, 128]" in first  # widths read as written
    assert "top_mlp" not in first  # the preset's DLRM widths: not DCNv2's setting


def test_flags_override_the_file_only_where_given(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"data": {"batch_size": 128, "path": "d"}, "optim": {"lr": 0.5},
                                "model": {"top_mlp": [32]}}))
    config = load_config(str(path), {"data.batch_size": 64, "model.dropout": 0.1})
    assert (config.data.batch_size, config.data.path, config.optim.lr) == (64, "d", 0.5)
    assert (config.model.arch.top_mlp, config.model.dropout, config.model.arch.bottom_mlp) == ((32,), 0.1, (64, 32))
    assert config.epochs == TrainConfig().epochs  # neither file nor flag: the default


@pytest.mark.parametrize("text, message", [
    ("model:\n  widht: 3\n", "unknown key 'model.widht'"),
    ("epoch: 3\n", "unknown key 'epoch'"),
    ("optim:\n  lr: fast\n", "optim.lr must be a number, got 'fast'"),
    ("model:\n  bottom_mlp: [64, -1]\n", "model.bottom_mlp must be a list of positive integers"),
    ("precision: fp16\n", "precision must be one of auto, fp32, bf16, fp8, got 'fp16'"),
    ("data: 3\n", "data must be a mapping of fields"),
    ("model: {name: dlrm\n", "line 2, column 1: expected ',' or '}'"),
])
def test_a_bad_config_file_is_one_line_naming_the_key_and_the_file(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="bad.yaml") as err:
        read_config(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert f"{path}" in capsys.readouterr().err


def test_a_missing_config_names_the_presets(capsys):
    assert main(["train", "--config", "no-such-run", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "no such file or preset" in err and "mlperf-dlrm" in err


def test_every_config_field_has_a_flag():
    def dotted(cls, prefix=""):
        for name, hint in section_types(cls).items():
            if dataclasses.is_dataclass(hint):
                yield from dotted(hint, f"{name}.")
            else:
                yield prefix + name

    fields = set(dotted(TrainConfig))
    assert {"model.cross_rank", "model.top_mlp", "model.deep_mlp", "model.embedding_dim"} <= fields
    flagged = [key for _flag, key, _options, _help in all_flags()]
    assert sorted(flagged) == sorted(fields)  # each field once


def test_flags_reach_the_new_fields(capsys):
    out = printed_config(capsys, "--data", "d", "--out", "o", "--bottom-mlp", "16", "--top-mlp", "", "--cross-layers",
                         "2", "--weight-decay", "1e-5", "--decay-steps", "100", "--decay-power", "1.5",
                         "--min-lr-factor", "0.1", "--keep-checkpoints", "5", "--prefetch", "0",
                         "--threads", "none", "--no-progress")
    import yaml

    config = TrainConfig.from_dict(yaml.safe_load(out))
    assert (config.model.arch.bottom_mlp, config.model.arch.top_mlp) == ((16,), ())
    assert "cross_layers" not in out  # DCNv2's setting: DLRM runs
    assert (config.optim.weight_decay, config.optim.decay_steps, config.optim.decay_power,
            config.optim.min_lr_factor) == (1e-5, 100, 1.5, 0.1)
    assert (config.keep_checkpoints, config.data.prefetch, config.threads, config.progress) == (5, 0, None, False)


def test_the_mlperf_preset_is_the_criteo_1tb_dlrm_shape():
    assert "mlperf-dlrm" in preset_names()
    preset = load_config("mlperf-dlrm")
    assert (preset.model.name, preset.model.embedding_dim, preset.model.arch.bottom_mlp, preset.model.arch.top_mlp) \
        == ("dlrm", 128, (512, 256), (1024, 1024, 512, 256))
    assert (preset.data.batch_size, preset.optim.warmup_steps, preset.optim.decay_start_step) == (65536, 500, 4000)
    dcn = criteo_1tb_config("d", "o", "dcnv2")  # the same file gives DCNv2 its own settings
    assert dcn.model.arch == DCNv2Config(bottom_mlp=(512, 256), deep_mlp=(1024, 1024, 512, 256), cross_layers=3,
                                         cross_rank=512)
    assert dcn == dataclasses.replace(preset, out="o", data=dataclasses.replace(preset.data, path="d"),
                                      model=dataclasses.replace(preset.model, name="dcnv2", arch=dcn.model.arch))


def test_presets_are_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "mlperf-dlrm" in capsys.readouterr().out


def test_train_without_data_or_out_says_which_is_missing(capsys):
    assert main(["train", "--config", "mlperf-dlrm"]) == 2
    assert "--data and --out required" in capsys.readouterr().err


# the model section as `--print-config` wrote it before models owned their settings: every model's fields
OLD_MODEL_SECTION = """model:
  name: wide_deep
  embedding_dim: 8
  bottom_mlp: [64, 32]
  top_mlp: [128, 64]
  deep_mlp: [48, 24]
  cross_layers: 3
  cross_rank: 32
  dropout: 0.1
  embedding_init_scale: 0.1
"""


def test_a_config_file_of_the_flat_model_section_still_loads(tmp_path, capsys):
    (tmp_path / "old.yaml").write_text(OLD_MODEL_SECTION + "epochs: 2\n")
    config = load_config(str(tmp_path / "old.yaml"))
    assert (config.model.name, config.model.embedding_dim, config.model.dropout, config.epochs) == \
        ("wide_deep", 8, 0.1, 2)
    assert config.model.arch_kwargs() == {"deep_mlp": [48, 24], "dropout": 0.1}
    switched = load_config(str(tmp_path / "old.yaml"), {"model.name": "dcnv2", "model.cross_rank": 16})
    assert (switched.model.arch.deep_mlp, switched.model.arch.cross_rank) == ((48, 24), 16)
    new = printed_config(capsys, "--config", str(tmp_path / "old.yaml"))
    assert "deep_mlp: [48, 24]" in new and "top_mlp" not in new and "cross_rank" not in new


def test_an_old_checkpoints_config_json_still_loads(tmp_path):
    import yaml

    model = yaml.safe_load(OLD_MODEL_SECTION)["model"] | {"name": "dcnv2"}
    asked = {"out": "ckpt", "data": {"path": "d", "batch_size": 256}, "model": model, "optim": {"lr": 0.01}}
    (tmp_path / "config.json").write_text(json.dumps({"asked": asked, "resolved": asked, "plan": {}}))
    config = load_config(str(tmp_path / "config.json"))
    assert config.model == ModelConfig(name="dcnv2", embedding_dim=8, dropout=0.1, arch=DCNv2Config(
        bottom_mlp=(64, 32), deep_mlp=(48, 24), cross_layers=3, cross_rank=32))
    assert TrainConfig.from_dict(asked) == config  # as checkpoints read it back
