"""The training benchmark's real-size models have the published models' parameter counts and
tensor shapes (numbers from torchvision's and Hugging Face's model cards, not from this code)."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import realmodels  # noqa: E402


def _meta(name):
    with torch.device("meta"):
        return realmodels.REAL_MODELS[name]()


def test_resnet50_has_torchvision_resnet50s_parameters():
    model = _meta("resnet50")
    assert realmodels.count(model) == 25_557_032
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert len(shapes) == 161
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)
    assert shapes["layer4.0.downsample.0.weight"] == (2048, 1024, 1, 1)
    assert shapes["fc.weight"] == (1000, 2048)


def test_bert_base_trunk_has_bert_base_uncaseds_parameters():
    model = _meta("bert")
    head = sum(p.numel() for p in model.classifier.parameters())
    assert realmodels.count(model) - head == 109_482_240
    assert head == 768 * 2 + 2
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["word.weight"] == (30522, 768)
    assert shapes["position.weight"] == (512, 768)
    assert shapes["layers.11.intermediate.weight"] == (3072, 768)
    assert sum(1 for n in shapes if n.startswith("layers.0.")) == 16


def test_gpt2_small_has_gpt2s_parameters_with_the_head_tied():
    model = _meta("gpt2")
    assert realmodels.count(model) == 124_439_808
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert len(shapes) == 148
    assert shapes["wte.weight"] == (50257, 768)
    assert shapes["h.0.c_attn.weight"] == (768, 2304)      # Conv1D: (in, out)
    assert shapes["h.11.mlp_proj.weight"] == (3072, 768)


@pytest.mark.parametrize("name", ["resnet50", "bert", "gpt2"])
def test_a_small_batch_trains_one_step(name):
    torch.manual_seed(0)
    model = realmodels.REAL_MODELS[name]()
    g = torch.Generator().manual_seed(0)
    x, y = realmodels.sample(name, 2, g, image_size=32, seq_len=8)
    loss = realmodels.loss(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(
        {"resnet50": 1000.0, "bert": 2.0, "gpt2": 50257.0}[name])).item()) < 3.0
