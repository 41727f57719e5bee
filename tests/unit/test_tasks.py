import dataclasses

import pytest
import torch

from swarmloco.core.config import from_mapping
from swarmloco.core.manifest import SwarmManifest
from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.spec import GPT_PRESETS, GPTConfig
from swarmloco.train.tasks import RunConfig, build_manifest, get_task, run_from_manifest


def test_manifest_round_trip_gives_back_the_run():
    m = build_manifest("gpt-bytes", "tiny", creator="ab" * 32, name="t")
    again = SwarmManifest.from_bytes(m.to_bytes(), expected_id=m.swarm_id)
    task, model, data, run = run_from_manifest(again)
    assert task.name == "gpt-bytes"
    assert model == dataclasses.asdict(GPT_PRESETS["tiny"])
    assert data.source == "stdlib"
    assert run.spec.outer.lr == 0.7 and run.spec.streaming.sync_every == 50
    assert run.spec.total_steps == run.inner.total_steps  # the run ends with the schedule
    default = task.default_run("tiny")
    assert default.spec.aggregator is None  # the run's default: chosen with the manifest
    assert run == dataclasses.replace(default, spec=default.spec.for_run(private=False))
    assert run.spec.aggregator is not None and run.spec.aggregator.method == "trimmed_mean"
    private = build_manifest("gpt-bytes", "tiny", creator="ab" * 32, admission="certificate")
    spec = run_from_manifest(private)[3].spec
    assert spec.aggregator is not None and spec.aggregator.method == "mean"
    # The signature pins the model down: the preset's parameters, the seed's weights.
    signature = again.model["signature"]
    names = [name for name, *_ in signature["params"]]
    built = task.build_model(model)
    assert names == [n for n, _ in built.named_parameters()]


def test_a_pinned_dataset_round_trips_and_is_described():
    from swarmloco.train.spec import DataSpec
    from swarmloco.train.tasks import describe_manifest

    pinned = DataSpec(source="dataset", dataset="ab" * 20, mirrors=("http://127.0.0.1:9/d",))
    m = build_manifest("gpt-bytes", "tiny", creator="ab" * 32, data=pinned)
    again = SwarmManifest.from_bytes(m.to_bytes(), expected_id=m.swarm_id)
    assert run_from_manifest(again)[2] == pinned
    assert "data:    dataset abab" in describe_manifest(again, None)
    assert "from http://127.0.0.1:9/d and the peers" in describe_manifest(again, None)


def test_local_choices_stay_out_of_the_manifest():
    m = build_manifest("gpt-bytes", "tiny", creator="")
    assert "precision" not in m.hparams["inner"] and "compile" not in m.hparams["inner"]
    assert "backend" not in m.hparams["run"]["codec"]


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'nope'; known tasks: gpt-bytes"):
        get_task("nope")
    with pytest.raises(ValueError, match="unknown preset 'xl'"):
        build_manifest("gpt-bytes", "xl", creator="")
    with pytest.raises(ValueError, match="unknown RunConfig option"):
        RunConfig.from_manifest({"bogus": 1})
    with pytest.raises(ValueError, match="known options"):
        from_mapping(InnerConfig, {"learning_rate": 1})


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_param_count_formula(preset):
    cfg = GPT_PRESETS[preset]
    model = get_task("gpt-bytes").build_model(dataclasses.asdict(cfg))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_base_preset_is_about_125m():
    assert 115e6 < GPT_PRESETS["base"].num_params() < 135e6


def test_gpt_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=130, n_head=4)


def test_inner_step_lowers_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = get_task("gpt-bytes").build_model(
        dataclasses.asdict(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    )
    loop = InnerLoop(
        model, InnerConfig(lr=3e-3, warmup_steps=0, batch_size=4, grad_accum=2), torch.device("cpu")
    )
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))

    def batches():
        while True:
            yield x[:, :-1], x[:, 1:]

    it = batches()
    first = loop.train_step(it)
    for _ in range(30):
        last = loop.train_step(it)
    assert last < first - 1.0
    assert loop.step == 31
    state = loop.state_dict()
    assert state["step"] == 31
