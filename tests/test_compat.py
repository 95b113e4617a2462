"""llmstack.compat: a test per DeepSpeed and transformers internal llmstack uses, so that a version
bump that removes or changes one fails here, and the refusal of an unsupported version or a missing
internal (monkeypatched away) with one message naming the supported range.

Engine-level internals are exercised on real engines (1 rank, gloo, tiny model) in one subprocess."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
import torch

from llmstack.compat import IncompatibleLibraryError, SupportedRange
from llmstack.compat import deepspeed as ds_compat
from llmstack.compat import transformers as tf_compat
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.testing import run_distributed

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
DS_RANGE = ds_compat.SUPPORTED_DEEPSPEED.specifier
TF_RANGE = tf_compat.SUPPORTED_TRANSFORMERS.specifier


def tiny_model(**overrides):
    torch.manual_seed(0)
    fields = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    return LLMStackForCausalLM(LLMStackConfig(**{**fields, **overrides}))


def refusal(check):
    """The IncompatibleLibraryError message `check()` raises."""
    with pytest.raises(IncompatibleLibraryError) as error:
        check()
    return str(error.value)


# ---- the supported range


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.19.8", True),
        ("0.19.9rc1", True),
        ("0.19.7", False),
        ("0.20.0", False),
        ("0.20.0.dev0", False),
        ("x", False),
    ],
)
def test_supported_range_contains(version, supported):
    assert SupportedRange("deepspeed", ">=0.19.8,<0.20").contains(version) is supported


def test_installed_versions_are_supported_and_complete():
    assert ds_compat.installed_problems() == []
    assert tf_compat.installed_problems() == []
    ds_compat.check_installed()
    tf_compat.check_installed()


@pytest.mark.parametrize("version", ["0.16.9", "0.20.0"])
def test_deepspeed_outside_the_range_is_refused(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    message = refusal(ds_compat.check_installed)
    assert f"deepspeed {version} is installed" in message and f"deepspeed{DS_RANGE}" in message
    assert f"pip install 'deepspeed{DS_RANGE}'" in message and "\n" not in message


@pytest.mark.parametrize("version", ["5.23.0", "6.0.0"])
def test_transformers_outside_the_range_is_refused(monkeypatch, version):
    # The module the check reads: importing transformers' models can put a new top-level module
    # object in sys.modules (its lazy-module machinery), so `transformers` here may be another one.
    monkeypatch.setattr(tf_compat.transformers, "__version__", version)
    message = refusal(tf_compat.check_installed)
    assert f"transformers {version} is installed" in message and f"pip install 'transformers{TF_RANGE}'" in message


def test_a_command_refuses_an_unsupported_library_in_one_line():
    code = (
        "import sys, deepspeed; deepspeed.__version__ = '0.20.0'; "
        "from llmstack.cli.main import main; sys.exit(main(['train', '--config', 'missing.yaml']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr
    expected = (
        f"llmstack train: error: deepspeed 0.20.0 is installed, but llmstack supports deepspeed{DS_RANGE}; "
        f"install a supported version: pip install 'deepspeed{DS_RANGE}'"
    )
    assert [line for line in result.stderr.splitlines() if "error" in line] == [expected]
    assert "Traceback" not in result.stderr


# ---- DeepSpeed: modules and classes (checked on import)


@pytest.mark.parametrize(
    "module, name",
    [(module, name) for module, names in ds_compat.INTERNAL_NAMES.items() for name in names],
)
def test_each_deepspeed_internal_is_there_and_its_absence_refused(monkeypatch, module, name):
    assert hasattr(importlib.import_module(module), name)
    monkeypatch.delattr(importlib.import_module(module), name)
    message = refusal(ds_compat.check_installed)
    assert f"{module}.{name}" in message and f"deepspeed{DS_RANGE}" in message


def test_checkpoint_engine_base_leaves_only_what_llmstack_defines(monkeypatch):
    from llmstack.training.checkpoint.engine import ManifestCheckpointEngine

    base = ds_compat.checkpoint_engine_base()
    assert issubclass(ManifestCheckpointEngine, base)
    assert not ManifestCheckpointEngine.__abstractmethods__  # instantiable
    monkeypatch.setattr(
        base,
        "__abstractmethods__",
        frozenset({"create", "save", "load", "commit", "flush"}),
    )
    assert "CheckpointEngine with no abstract methods beyond" in refusal(ds_compat.check_installed)


def test_dynamic_loss_scaler_honours_raise_error_at_min_scale(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    def at_min_scale(raise_error):
        return DynamicLossScaler(
            init_scale=1,
            scale_window=10,
            min_scale=1,
            delayed_shift=1,
            consecutive_hysteresis=False,
            raise_error_at_min_scale=raise_error,
        )

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it logs the overflow on rank 0
    switched_off = at_min_scale(False)
    switched_off.update_scale(True)  # an overflow at the minimum: no exception when switched off
    assert switched_off.cur_scale == 1
    with pytest.raises(Exception, match="minimum"):
        at_min_scale(True).update_scale(True)
    monkeypatch.setattr(DynamicLossScaler, "__init__", lambda self, init_scale: None)
    assert "DynamicLossScaler(raise_error_at_min_scale=...)" in refusal(ds_compat.check_installed)


def test_ds_to_universal_arguments_come_from_its_own_parser(monkeypatch):
    args = ds_compat.ds_to_universal_args("in_dir", "out_dir")
    assert (
        args.input_folder,
        args.output_folder,
        args.num_extract_workers,
        args.num_merge_workers,
    ) == ("in_dir", "out_dir", 1, 1)
    assert args.strict is True and args.inject_missing_state is False and args.keep_temp_folder is False
    from deepspeed.checkpoint import ds_to_universal

    def parser_without_worker_options():
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--input_folder")
        parser.add_argument("--output_folder")
        return parser.parse_args()

    monkeypatch.setattr(ds_to_universal, "parse_arguments", parser_without_worker_options)
    message = refusal(ds_compat.check_installed)
    assert "ds_to_universal options" in message and "unrecognized arguments" in message


def test_accelerator_fp16_switch(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", accelerator.is_fp16_supported)  # restored afterwards
    ds_compat.enable_fp16_on_cpu()
    assert accelerator.is_fp16_supported() is True


def test_checkpoint_state_classes_load_under_weights_only(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from llmstack.safe_load import load_tensors

    scaler = DynamicLossScaler(
        init_scale=4,
        scale_window=10,
        min_scale=1,
        delayed_shift=1,
        consecutive_hysteresis=False,
    )
    torch.save({"scaler": scaler}, tmp_path / "state.pt")
    assert load_tensors(tmp_path / "state.pt")["scaler"].cur_scale == 4
    assert all(isinstance(c, type) for c in ds_compat.checkpoint_state_classes())


def test_rng_tracker_forks_a_named_stream():
    tracker = ds_compat.rng_tracker()
    saved = tracker.get_states()
    try:
        tracker.reset()
        tracker.add("compat-test", 1234)
        with tracker.fork("compat-test"):
            inside = torch.rand(3)
        tracker.reset()
        tracker.add("compat-test", 1234)
        with tracker.fork("compat-test"):
            assert torch.equal(torch.rand(3), inside)
    finally:
        tracker.reset()
        tracker.set_states(saved)


def test_pipe_data_parallel_topology_axes():
    layout = ds_compat.pipe_data_parallel_topology(pipeline=2, tensor=2, data=1)
    assert layout.get_coord(3) == layout.ProcessCoord(pipe=1, data=0, model=1)
    assert layout.get_axis_comm_lists("model") == [[0, 1], [2, 3]]
    assert layout.filter_match(pipe=0) == [0, 1]


def test_op_report_names_every_op():
    report = ds_compat.op_report()
    assert set(report) == {"prebuilt", "buildable", "not buildable"}
    assert not set(report["buildable"]) & set(report["not buildable"])
    assert report["buildable"] or report["not buildable"]


def test_tensor_parallel_mark_is_what_deepspeed_reads(monkeypatch):
    from deepspeed.runtime import utils

    param = torch.nn.Parameter(torch.zeros(2))
    assert not utils.is_model_parallel_parameter(param) and not ds_compat.is_tensor_parallel(param)
    ds_compat.mark_tensor_parallel(param)
    assert utils.is_model_parallel_parameter(param) and ds_compat.is_tensor_parallel(param)
    monkeypatch.setattr(utils, "is_model_parallel_parameter", lambda p: hasattr(p, "model_parallel"))
    assert "tensor_model_parallel mark" in refusal(ds_compat.check_installed)


def test_full_shape_reads_zero3_placeholders_and_refuses_a_missing_shape():
    whole = torch.nn.Parameter(torch.zeros(3, 4))
    assert ds_compat.full_shape(whole) == (3, 4)
    placeholder = torch.nn.Parameter(torch.zeros(6))  # what ZeRO-3 leaves on a rank
    placeholder.ds_id, placeholder.ds_shape = 0, torch.Size([3, 4])
    assert ds_compat.full_shape(placeholder) == (3, 4)
    del placeholder.ds_shape
    assert "ds_shape" in refusal(lambda: ds_compat.full_shape(placeholder))


def test_checkpoint_file_names_are_parsed_in_one_place(tmp_path):
    names = [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "layer_00-model_00-model_states.pt",
        "layer_03-model_01-model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",  # ZeRO-3's per-rank module state: none of the above
        "zero_to_fp32.py",
        "latest",
    ]
    for name in names:
        (tmp_path / name).touch()
    files = ds_compat.checkpoint_files(tmp_path)
    assert {k: v.name for k, v in files.model_states.items()} == {
        0: names[0],
        1: names[1],
    }
    assert sorted(files.layer_states) == [(0, 0), (3, 1)]
    assert sorted(files.zero_shards) == [(0, 0), (1, 0)]
    assert files.zero_layout() == (2, 1)
    (tmp_path / "empty").mkdir()
    assert ds_compat.checkpoint_files(tmp_path / "empty").zero_layout() == (0, 0)


# ---- DeepSpeed: engine attributes (checked by check_engine), on stand-in engines


def stand_in_engine():
    """An object with every engine attribute check_engine looks at, on a plain torch optimizer."""
    engine = SimpleNamespace(
        _config=SimpleNamespace(load_universal_checkpoint=False),
        enable_backward_allreduce=True,
        checkpoint_engine=None,
        skipped_steps=0,
        module=torch.nn.Linear(1, 1),
        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
        device=torch.device("cpu"),
        dp_world_size=1,
        mp_world_size=1,
        global_steps=0,
        global_samples=0,
        fp16_enabled=lambda: False,
        dynamic_loss_scale=lambda: False,
    )
    engine.basic_optimizer = engine.optimizer
    engine.load_universal_checkpoint = lambda: engine._config.load_universal_checkpoint
    return engine


def test_check_engine_accepts_an_engine_with_every_attribute():
    ds_compat.check_engine(stand_in_engine())


@pytest.mark.parametrize("name", ds_compat.ENGINE_ATTRIBUTES + ds_compat.ENGINE_PLAIN_ATTRIBUTES)
def test_check_engine_refuses_an_engine_without(name):
    engine = stand_in_engine()
    delattr(engine, name)
    message = refusal(lambda: ds_compat.check_engine(engine))
    assert f"DeepSpeedEngine.{name}" in message and f"deepspeed{DS_RANGE}" in message


def test_check_engine_refuses_a_config_without_the_universal_switch():
    engine = stand_in_engine()
    del engine._config.load_universal_checkpoint
    assert "DeepSpeedConfig.load_universal_checkpoint" in refusal(lambda: ds_compat.check_engine(engine))


def test_backward_allreduce_switch_is_refused_when_absent():
    engine = stand_in_engine()
    ds_compat.disable_backward_allreduce(engine)
    assert engine.enable_backward_allreduce is False
    del engine.enable_backward_allreduce
    assert "enable_backward_allreduce" in refusal(lambda: ds_compat.disable_backward_allreduce(engine))


def test_universal_loading_is_refused_when_the_engine_ignores_the_switch():
    engine = stand_in_engine()
    with ds_compat.universal_checkpoint_loading(engine):
        assert engine.load_universal_checkpoint() is True
    assert engine._config.load_universal_checkpoint is False
    engine.load_universal_checkpoint = lambda: False  # a DeepSpeed that reads it from elsewhere
    with (
        pytest.raises(IncompatibleLibraryError, match="load_universal_checkpoint"),
        ds_compat.universal_checkpoint_loading(engine),
    ):
        pass
    assert engine._config.load_universal_checkpoint is False


def test_installing_a_checkpoint_engine_needs_the_attribute_and_the_base_class():
    from llmstack.training.checkpoint.engine import ManifestCheckpointEngine

    engine = stand_in_engine()
    ours = ManifestCheckpointEngine()
    ds_compat.install_checkpoint_engine(engine, ours)
    assert engine.checkpoint_engine is ours
    with pytest.raises(TypeError):
        ds_compat.install_checkpoint_engine(engine, object())
    del engine.checkpoint_engine
    assert "checkpoint_engine" in refusal(lambda: ds_compat.install_checkpoint_engine(engine, ours))


def test_zero_state_of_unknown_optimizers():
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    assert ds_compat.zero_state_tensors(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) == ([], [])
    unknown = type("NewZeroOptimizer", (ZeROOptimizer,), {})()
    assert "NewZeroOptimizer" in refusal(lambda: ds_compat.zero_state_tensors(unknown))


# ---- DeepSpeed: real engines, one rank


def ds_config(name, top_level=None, **zero):
    config = json.loads((DS_CONFIGS / f"{name}.json").read_text())
    config.update(top_level or {})
    config.update(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        steps_per_print=10**6,
    )
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    config["zero_optimization"].update(zero)
    return config


def train_step(engine, step):
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()


def save_and_load(engine, directory, tag="t"):
    """Save through an installed ManifestCheckpointEngine that counts its loads, then load."""
    from llmstack.safe_load import safe_loading
    from llmstack.training.checkpoint.engine import ManifestCheckpointEngine

    class CountingEngine(ManifestCheckpointEngine):
        loads = 0

        def load(self, path, map_location=None):
            CountingEngine.loads += 1
            return super().load(path, map_location)

    ours = CountingEngine()
    ds_compat.install_checkpoint_engine(engine, ours)
    engine.save_checkpoint(
        str(directory),
        tag=tag,
        client_state={"universal_checkpoint_info": ds_compat.universal_checkpoint_info([], [], [])},
    )
    written = ours.finish(lambda written, errors: sorted(os.path.basename(p) for p in written)).result()
    files = ds_compat.checkpoint_files(directory / tag)
    with safe_loading():
        loaded, _ = engine.load_checkpoint(str(directory), tag=tag)
    return {
        "written": written,
        "on_disk": sorted(n for n in os.listdir(directory / tag) if n.endswith(".pt")),
        "model_states": sorted(files.model_states),
        "zero_shards": sorted(files.zero_shards),
        "loaded": loaded is not None,
        "loads": CountingEngine.loads,
    }


def count_tensors(objects):
    from llmstack.training.memory import tensors_in

    return len(tensors_in(objects))


def engine_facts(rank, world_size, directory):
    from llmstack.optim import initialize
    from llmstack.safe_load import safe_loading

    directory = Path(directory)
    ds_compat.enable_fp16_on_cpu()
    facts = {}

    def build(name, top_level=None, **zero):
        model = tiny_model()
        engine, *_ = initialize(model, ds_config(name, top_level, **zero), model.parameters())  # runs check_engine
        return engine

    # ZeRO-0 fp32: the backward all-reduce switch, the universal switch, the checkpoint engine.
    engine = build("zero1", stage=0)
    calls = []
    original = engine.allreduce_gradients
    engine.allreduce_gradients = lambda *a, **k: calls.append(1) or original(*a, **k)
    train_step(engine, 0)
    facts["allreduces_switched_on"] = len(calls)
    ds_compat.disable_backward_allreduce(engine)
    calls.clear()
    train_step(engine, 1)
    facts["allreduces_switched_off"] = len(calls)
    facts["skipped_steps"] = ds_compat.skipped_steps(engine)
    facts["zero0"] = save_and_load(engine, directory / "zero0")

    # ZeRO-2 fp16: loss scale, the scaler's raise switch, ZeRO-2 state, universal conversion and load.
    engine = build("fp16_zero2")
    train_step(engine, 0)
    facts["loss_scale"] = ds_compat.loss_scale(engine)
    facts["min_loss_scale"] = ds_compat.min_loss_scale(engine)
    ds_compat.leave_min_loss_scale_to_caller(engine)
    facts["raise_at_min_scale"] = engine.optimizer.loss_scaler.raise_error_at_min_scale
    masters, _ = ds_compat.zero_state_tensors(engine.optimizer)
    facts["zero2_state"] = (type(engine.optimizer).__name__, count_tensors(masters))
    facts["zero2"] = save_and_load(engine, directory / "zero2")
    with safe_loading():
        ds_compat.convert_to_universal(str(directory / "zero2" / "t"), str(directory / "universal" / "t"))
    facts["universal_files"] = sorted(os.listdir(directory / "universal" / "t"))
    with ds_compat.universal_checkpoint_loading(engine), safe_loading():
        facts["universal_switch_inside"] = engine.load_universal_checkpoint()
        loaded, _ = engine.load_checkpoint(str(directory / "universal"), tag="t")
    facts["universal_loaded"] = loaded is not None
    facts["universal_switch_after"] = engine.load_universal_checkpoint()

    # ZeRO-3: master and gradient partitions, parameter partitions.
    engine = build("zero3", stage3_param_persistence_threshold=0)
    masters, _ = ds_compat.zero_state_tensors(engine.optimizer)
    params = list(engine.module.parameters())
    facts["zero3_state"] = (
        type(engine.optimizer).__name__,
        count_tensors(masters),
        len(ds_compat.zero3_parameter_partitions(engine.optimizer, params)),
        len(params),
    )

    # DeepSpeed's BF16_Optimizer: bf16 at ZeRO-1 accumulating gradients in fp32 (or under pipeline parallelism).
    engine = build("bf16_zero1", {"data_types": {"grad_accum_dtype": "fp32"}})
    masters, _ = ds_compat.zero_state_tensors(engine.optimizer)
    facts["bf16_state"] = (type(engine.optimizer).__name__, count_tensors(masters))

    # Stage 0 in bf16 and fp16 (DeepSpeed's FP16_Optimizer around its fused Adam, FP16_UnfusedOptimizer
    # around torch's): built without an optimizer step, so one train step is Adam's first.
    for name, adam in (("bf16_zero0", {}), ("fp16_zero0", {"torch_adam": True})):
        model = tiny_model()
        config = ds_config(name)
        config["optimizer"]["params"] = {"lr": 1e-3, "weight_decay": 0.1, **adam}
        engine, *_ = initialize(model, config, model.parameters())
        adam_state = engine.optimizer.optimizer.state
        states_before = len(adam_state)
        train_step(engine, 0)
        groups = engine.optimizer.optimizer.param_groups
        facts[f"{name}_first_step"] = (
            type(engine.optimizer).__name__,
            states_before,
            sorted({int(state["step"]) for state in adam_state.values()}),
            sorted({(group["lr"], group["weight_decay"]) for group in groups}),
        )

    # A PipelineModule's state-dict keys, renamed to the plain model's.
    from llmstack.parallel import Topology, to_pipeline

    topology = Topology(1, 1)
    for tied in (True, False):
        plain = tiny_model(tie_word_embeddings=tied).state_dict()
        renamed = to_pipeline(tiny_model(tie_word_embeddings=tied), topology).plain_state_dict()
        facts[f"pipeline_keys_tied_{tied}"] = (sorted(plain), sorted(renamed))
        facts[f"pipeline_equal_tied_{tied}"] = all(torch.equal(plain[k], renamed[k]) for k in plain if k in renamed)
    return facts


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return run_distributed(engine_facts, world_size=1, args=(str(tmp_path_factory.mktemp("compat")),))[0]


def test_engine_honours_the_backward_allreduce_switch(facts):
    assert facts["allreduces_switched_on"] >= 1
    assert facts["allreduces_switched_off"] == 0


def test_engine_counts_skipped_steps(facts):
    assert facts["skipped_steps"] == 0


@pytest.mark.parametrize("stage", ["zero0", "zero2"])
def test_engine_saves_and_loads_every_file_through_the_installed_checkpoint_engine(facts, stage):
    saved = facts[stage]
    assert saved["written"] and set(saved["on_disk"]) <= set(saved["written"])
    assert saved["loaded"] and saved["loads"] >= 1


def test_checkpoint_file_names_of_real_checkpoints(facts):
    assert (facts["zero0"]["model_states"], facts["zero0"]["zero_shards"]) == ([0], [])
    assert (facts["zero2"]["model_states"], facts["zero2"]["zero_shards"]) == (
        [0],
        [(0, 0)],
    )


def test_fp16_loss_scale_and_the_scalers_raise_switch(facts):
    assert facts["loss_scale"] > 1 and facts["min_loss_scale"] == 1
    assert facts["raise_at_min_scale"] is False


def test_ds_to_universal_converts_and_the_universal_switch_loads_it(facts):
    assert "zero" in facts["universal_files"]
    assert facts["universal_switch_inside"] is True and facts["universal_switch_after"] is False
    assert facts["universal_loaded"]


@pytest.mark.parametrize(
    "stage, optimizer",
    [
        ("zero2", "DeepSpeedZeroOptimizer"),
        ("zero3", "DeepSpeedZeroOptimizer_Stage3"),
        ("bf16", "BF16_Optimizer"),
    ],
)
def test_zero_state_is_where_the_memory_report_looks(facts, stage, optimizer):
    name, masters, *partitions = facts[f"{stage}_state"]
    assert name == optimizer and masters >= 1
    if partitions:
        held, params = partitions
        assert held == params


@pytest.mark.parametrize("name, wrapper", [("bf16_zero0", "FP16_Optimizer"), ("fp16_zero0", "FP16_UnfusedOptimizer")])
def test_stage0_low_precision_optimizers_start_at_adams_first_step(facts, name, wrapper):
    """DeepSpeed creates their state by a step on zero gradients, which Adam would count (its first
    real update bias-corrected as the second: 0.744 x lr) and AdamW would decay the weights in."""
    kind, states_before, steps, settings = facts[f"{name}_first_step"]
    assert kind == wrapper
    assert states_before == 0 and steps == [1]
    assert settings == [(1e-3, 0.1)]  # the optimizer's own settings, restored after the state-creating step


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_state_keys_map_to_the_plain_model(facts, tied):
    plain, renamed = facts[f"pipeline_keys_tied_{tied}"]
    assert renamed == plain and facts[f"pipeline_equal_tied_{tied}"]


def test_split_pipeline_state_key():
    assert ds_compat.split_pipeline_state_key("3.layer.mlp.up_proj.weight") == (3, "layer.mlp.up_proj.weight")
    assert ds_compat.split_pipeline_state_key("tied_modules.embed.embed_tokens.weight") == (
        "embed",
        "embed_tokens.weight",
    )


# ---- transformers


@pytest.mark.parametrize("name", tf_compat.INIT_FUNCTIONS)
def test_weight_init_functions_leave_loaded_weights_alone(monkeypatch, name):
    init = tf_compat.weight_init()
    args = {
        "normal_": (),
        "xavier_uniform_": (),
        "ones_": (),
        "copy_": (torch.zeros(2, 2),),
    }[name]
    loaded = torch.full((2, 2), 7.0)
    loaded._is_hf_initialized = True
    getattr(init, name)(loaded, *args)
    assert torch.equal(loaded, torch.full((2, 2), 7.0))
    fresh = torch.full((2, 2), 7.0)
    getattr(init, name)(fresh, *args)
    assert not torch.equal(fresh, torch.full((2, 2), 7.0))
    monkeypatch.delattr(init, name)
    assert f"transformers.initialization.{name}" in refusal(tf_compat.check_installed)


def test_model_output_has_the_cache_field(monkeypatch):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    assert "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}

    @dataclasses.dataclass
    class OldOutput:
        past_key_values: object = None

    monkeypatch.setattr(tf_compat, "CausalLMOutputWithPast", OldOutput)
    assert "CausalLMOutputWithPast.cache" in refusal(tf_compat.check_installed)


def test_dynamic_cache_takes_the_config(monkeypatch):
    model = tiny_model()
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert out.cache.get_seq_length() == 3

    class OldCache:
        def __init__(self, ddp_cache_data=None):
            pass

    monkeypatch.setattr(tf_compat, "DynamicCache", OldCache)
    assert "DynamicCache(config=...)" in refusal(tf_compat.check_installed)


def test_activation_checkpointing_recomputes_each_layer_with_equal_gradients(
    monkeypatch,
):
    def gradients(model):
        model.train()
        batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=batch, labels=batch).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients(tiny_model())
    model = tiny_model()
    tf_compat.enable_activation_checkpointing(model)
    body = model.model
    calls = []
    checkpoint = body._gradient_checkpointing_func
    monkeypatch.setattr(
        body,
        "_gradient_checkpointing_func",
        lambda *a, **k: calls.append(1) or checkpoint(*a, **k),
    )
    recomputed = gradients(model)
    assert len(calls) == model.config.num_hidden_layers
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed))


def test_activation_checkpointing_that_does_not_take_is_refused(monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "_set_gradient_checkpointing", lambda self, **kwargs: None)
    message = refusal(lambda: tf_compat.enable_activation_checkpointing(tiny_model()))
    assert "_gradient_checkpointing_func" in message and f"transformers{TF_RANGE}" in message
    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
    assert "PreTrainedModel.activation_checkpointing_enable" in refusal(tf_compat.check_installed)


def test_the_collective_timeout_reaches_groups_created_without_one():
    """DeepSpeed creates its groups with `new_group(ranks)`: they get torch's default timeout,
    which llmstack.compat.torch_distributed sets to the run's train.collective_timeout_s."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    from llmstack.compat.torch_distributed import default_collective_timeout, set_default_collective_timeout

    before = default_collective_timeout()
    try:
        set_default_collective_timeout(timedelta(seconds=7))
        assert c10d._get_default_timeout(c10d.Backend("gloo")) == timedelta(seconds=7)
    finally:
        set_default_collective_timeout(before)
