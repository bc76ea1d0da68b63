"""One config: every command line's engine flags come from EngineConfig's fields (same names,
help, and the config's own defaults when a flag is left unset)."""
import dataclasses

import pytest

from jaxserve.cli import build_parser
from jaxserve.cli_args import engine_flags, engine_kwargs, flag_of
from jaxserve.engine.config import EngineConfig

COMMANDS = (["generate", "x"], ["serve"], ["bench"])
FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_engine_field_is_a_flag_with_the_fields_help(cmd, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(cmd[:1] + ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in FIELDS:
        if cmd[0] == "bench" and f.name == "max_model_len":
            continue  # bench fits it to the workload (its own flag, documented there)
        assert flag_of(f) in text and " ".join(f.metadata["help"].split()) in text, f.name
        value = [] if f.type == "bool" else ["7" if "int" in f.type else "0.5" if "float" in f.type else "xla"]
        if f.metadata.get("choices"):
            value = [f.metadata["choices"][-1]]
        args = build_parser().parse_args(cmd + [flag_of(f)] + value)
        assert f.name in engine_kwargs(args), f.name  # the flag sets that field
    args = build_parser().parse_args(cmd)
    kw = engine_kwargs(args)
    if cmd[0] == "bench":
        kw.pop("max_model_len", None)
    assert kw == {}  # nothing set: EngineConfig's defaults apply
    assert "--kv-format" in text and "--preset" in text


def test_flags_round_trip_into_the_config_and_onto_another_command_line():
    argv = ["serve", "--num-pages", "40", "--page-size", "8", "--no-prefix-caching", "--decode-weights", "int8",
            "--kv-cache-memory", "4MiB", "--memory-fraction", "0.5", "--attention-backend", "xla",
            "--prefill-from-decode-weights", "--kv-format", "fp8_e4m3"]
    args = build_parser().parse_args(argv)
    kw = engine_kwargs(args)
    assert kw == dict(num_pages=40, page_size=8, enable_prefix_caching=False, decode_weights="int8",
                      kv_cache_memory="4MiB", memory_fraction=0.5, attention_backend="xla",
                      prefill_from_decode_weights=True)
    cfg = EngineConfig(**kw)
    assert not cfg.enable_prefix_caching and cfg.num_pages == 40
    again = build_parser().parse_args(["serve"] + engine_flags(args))
    assert engine_kwargs(again) == kw and again.kv_format == "fp8_e4m3"


# Each command's model flags (ModelOptions): the defaults every command line has always had.
MODEL_FLAGS = {
    ("generate", "x"): dict(model=None, dtype="auto", num_devices=1),
    ("serve",): dict(model=None, dtype="auto", num_devices=None),
    ("convert", "a", "b"): dict(dtype="float32", kv_format=None),
    ("bench",): dict(model=None, dtype="float32"),
    ("experiment", "capacity"): dict(model=None, dtype="float32"),
    ("experiment", "weights"): dict(model=None, dtype="float32", kv_format="bf16"),
    ("experiment", "quality"): dict(model=None),
}


@pytest.mark.parametrize("cmd", list(MODEL_FLAGS))
def test_model_flags_come_from_one_declaration_with_each_commands_defaults(cmd):
    args = vars(build_parser().parse_args(list(cmd)))
    assert {k: args[k] for k in ("model", "dtype", "num_devices") if k in args} == \
        {k: v for k, v in MODEL_FLAGS[cmd].items() if k != "kv_format"}
    if "kv_format" in MODEL_FLAGS[cmd]:
        assert args["kv_format"] == MODEL_FLAGS[cmd]["kv_format"]
    auto = MODEL_FLAGS[cmd].get("dtype") == "auto"
    if "dtype" in args:
        assert vars(build_parser().parse_args([*cmd, "--dtype", "bfloat16"]))["dtype"] == "bfloat16"
        if not auto:
            with pytest.raises(SystemExit):
                build_parser().parse_args([*cmd, "--dtype", "auto"])


@pytest.mark.parametrize("cmd", [["generate", "x"], ["serve"]])
def test_the_default_model_runs_the_cpu_preset_only_when_nothing_is_asked(cmd):
    """generate / serve with no --model and no weight, preset, KV or dtype flag: preset "default"
    (the "cpu" preset on a CPU backend); any of those flags, or another checkpoint: as asked."""
    from jaxserve.cli_args import with_default_config

    def chosen(*flags):
        args = build_parser().parse_args(cmd + list(flags))
        return with_default_config(args, engine_kwargs(args)).get("preset")

    assert chosen() == "default"
    assert chosen("--max-num-seqs", "4") == "default"  # not a representation
    for flags in (["--model", "some/checkpoint"], ["--decode-weights", "bf16"], ["--kv-format", "float32"],
                  ["--dtype", "float32"], ["--preset", "as-loaded"], ["--tied-head-weights", "bf16"]):
        assert chosen(*flags) in (None, "as-loaded"), flags


def test_default_preset_resolves_to_the_cpu_preset_on_cpu(tmp_path):
    from tests.hf_models import build_llama
    from jaxserve import LLM
    from jaxserve.llm import PRESETS

    build_llama(tmp_path, num_hidden_layers=1, seed=1)
    llm = LLM(str(tmp_path), preset="default", num_pages=8, page_size=8)
    c, cpu = llm.engine.config, PRESETS["cpu"]
    assert (c.prefill_weights, c.decode_weights, c.tied_head_weights) == (
        cpu["prefill_weights"], cpu["decode_weights"], cpu["tied_head_weights"])
    assert LLM(str(tmp_path), preset="as-loaded", num_pages=8, page_size=8).engine.config.decode_weights is None
