"""train-draft --compile-draft: the compiled training forward gives the same losses and weights as the eager one
(CPU, fp32; inductor's CPU backend compiles in about a minute, hence `slow`)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec.models.config import load_target_config
from blockspec.train.data import Sample
from blockspec.train.features import TargetFeatures
from blockspec.train.model import DraftArch, TrainableDraft
from blockspec.train.options import TrainOptions
from blockspec.train.trainer import Dist, Trainer
from tiny_models import save_tiny_model


def train_three_steps(path: Path, compile_draft: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = load_target_config(path)
    features = TargetFeatures(path, [0, 2], torch.device("cpu"), torch.float32, 64)
    torch.manual_seed(0)
    draft = TrainableDraft(DraftArch.from_target(config, 2, 2, None))
    generator = torch.Generator().manual_seed(1)
    samples = [Sample(i, torch.randint(3, 90, (int(n),), generator=generator).tolist(),
                      torch.randint(3, 90, (int(m),), generator=generator).tolist())
               for i, (n, m) in enumerate([(5, 20), (9, 14), (3, 30), (7, 11)])]
    options = TrainOptions(target_model_path=str(path), data="", out="", num_layers=2, batch_size=2, blocks_per_seq=3,
                           block_size=4, compile_draft=compile_draft)
    trainer = Trainer(options, draft, features, samples, 95, torch.device("cpu"), Dist())
    # NOTE: batches of different context lengths, so the dynamic-shape compile meets more than one shape
    losses = [trainer.step(indices)[0] for indices in ([0, 1], [2, 3], [1, 2])]
    return losses, {name: p.detach().clone() for name, p in draft.named_parameters()}


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path: Path) -> None:
    path = tmp_path / "target"
    save_tiny_model("llama", path, residual_scale=0.3)
    eager_losses, eager_weights = train_three_steps(path, compile_draft=False)
    compiled_losses, compiled_weights = train_three_steps(path, compile_draft=True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    for name, weight in eager_weights.items():
        torch.testing.assert_close(compiled_weights[name], weight, atol=1e-5, rtol=1e-4, msg=name)


def test_inductor_options_turn_off_only_passes_this_torch_has() -> None:
    import torch._inductor.config as inductor_config

    from blockspec.train.trainer import UNSAFE_DYNAMIC_INDUCTOR_PASSES, draft_inductor_options

    options = draft_inductor_options() or {}
    assert set(options.values()) <= {False}
    for name in UNSAFE_DYNAMIC_INDUCTOR_PASSES:
        group, field_name = name.split(".")
        assert (name in options) == hasattr(getattr(inductor_config, group), field_name)
