"""flatshard train's config: validation, TOML round trip, command-line overrides, resolution."""

from __future__ import annotations

import dataclasses

import pytest

from flatshard.tools.train.cli import parse_config
from flatshard.tools.train.config import SECTIONS, OptimConfig, TrainConfig
from flatshard.tools.train.config_io import (
    apply_overrides,
    field_docs,
    from_dict,
    load_toml,
    to_toml,
)
from flatshard.tools.train.resolve import gpt_config, resolve


def test_every_field_has_a_docstring():
    for cls in [TrainConfig, *SECTIONS.values()]:
        names = {f.name for f in dataclasses.fields(cls)}
        assert names == set(field_docs(cls)), cls.__name__


def test_toml_round_trip(tmp_path):
    cfg = apply_overrides(
        TrainConfig(),
        [("steps", "7"), ("optim.lr", "1e-4"), ("data.packing", "false"),
         ("log.sample_prompt", 'say "hi"\\ \u00e9\t\x7f'), ("optim.grad_clip", "0")],
    )  # fmt: skip
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg, header="a header\non two lines"))
    assert load_toml(path) == cfg
    assert "# Peak learning rate" in path.read_text()  # docstrings become comments


def test_overrides_are_typed():
    cfg = apply_overrides(
        TrainConfig(),
        [("steps", "12"), ("optim.lr", "2e-3"), ("data.packing", "off"), ("data.path", "x.txt"),
         ("optim.lr", "5"), ("checkpoint.async_save", "yes")],
    )  # fmt: skip
    assert cfg.steps == 12 and isinstance(cfg.steps, int)
    assert cfg.optim.lr == 5.0 and isinstance(cfg.optim.lr, float)  # later override wins
    assert cfg.data.packing is False and cfg.checkpoint.async_save is True
    assert cfg.data.path == "x.txt"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (("optim.lrr", "1"), "unknown key in [optim] '--optim.lrr'; valid ones: optim.lr,"),
        (("optimizer.lr", "1"), "unknown section '--optimizer.lr'; valid ones: model, data,"),
        (("stepz", "1"), "unknown option '--stepz'"),
        (("steps", "ten"), "--steps 'ten': expected int"),
        (("data.packing", "maybe"), "expected true or false"),
        (("optim.lr", "-1"), "optim.lr=-1.0 is outside (0.0, inf]"),
        (("parallel.strategy", "zero3"), "use one of: full_shard, shard_grad_op"),
        (("model.preset", "huge"), "model.preset='huge' is not supported; use one of: tiny"),
    ],
)
def test_bad_overrides_name_the_setting(override, message):
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), [override])
    assert message in str(e.value)


def test_unknown_keys_in_toml_are_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("steps = 3\n[optim]\nlr = 1e-3\nmomentum = 0.9\n")
    with pytest.raises(ValueError, match=r"bad.toml: unknown key in \[optim\] 'momentum'"):
        load_toml(path)
    path.write_text("[trainer]\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"unknown top-level key or section 'trainer'.*\[optim\]"):
        load_toml(path)
    path.write_text("[optim]\nlr = 'fast'\n")
    with pytest.raises(TypeError, match=r"optim\.lr=.fast. has type str, expected float"):
        load_toml(path)
    path.write_text("steps = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_toml(tmp_path / "missing.toml")


def test_toml_int_for_float_is_fine():
    assert from_dict({"optim": {"lr": 1}}).optim.lr == 1.0


def test_command_line_order_and_shortcuts(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("steps = 5\nout = 'from_file'\n[optim]\nlr = 0.01\n")
    cfg, args = parse_config(
        ["--config", str(path), "--steps", "9", "--nproc", "3", "--data", "d.txt",
         "--optim.lr=0.02", "--log.every", "2", "--resume"]
    )  # fmt: skip
    assert (cfg.steps, cfg.out, cfg.parallel.nproc, cfg.data.path) == (9, "from_file", 3, "d.txt")
    assert cfg.optim.lr == 0.02 and cfg.log.every == 2 and args.resume
    with pytest.raises(ValueError, match="needs a value"):
        parse_config(["--optim.lr"])
    with pytest.raises(ValueError, match="unrecognised argument 'oops'"):
        parse_config(["oops"])


def test_resolve_fills_auto_values():
    cfg = resolve(TrainConfig(steps=40), cuda=False, local_world=2)
    assert cfg.parallel.nproc == 2 and cfg.parallel.backend == "gloo"
    assert cfg.precision.param_dtype == "bf16"  # faster on this CPU too (fp32 master shards)
    assert cfg.optim.decay_steps == 40  # the schedule spans the run unless set
    kept = resolve(TrainConfig(optim=OptimConfig(decay_steps=50)), cuda=False, local_world=2)
    assert kept.optim.decay_steps == 50


def test_gpt_config_applies_overrides():
    cfg = apply_overrides(TrainConfig(), [("model.d_model", "64"), ("data.seq_len", "32")])
    gpt = gpt_config(cfg)
    assert (gpt.d_model, gpt.n_layers, gpt.max_seq_len) == (64, 4, 32)  # tiny's 4 layers kept


def test_cli_reports_config_errors(capsys):
    from flatshard.tools.train.cli import main

    assert main(["--optim.nope", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatshard train: error: unknown key in [optim]")
    assert main(["--print-config", "--steps", "3"]) == 0
    assert "steps = 3" in capsys.readouterr().out


def test_cli_checks_optional_packages_before_launching(capsys, tmp_path):
    import importlib.util

    from flatshard.tools.train.cli import main

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed")
    assert main(["--log.tensorboard", "true", "--out", str(tmp_path / "o")]) == 2
    assert "needs the tensorboard package: pip install tensorboard" in capsys.readouterr().err
