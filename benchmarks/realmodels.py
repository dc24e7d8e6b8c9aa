"""Models of real size for the training benchmark, written by hand (no torchvision or
transformers dependency) with the parameter tensors of the published models, shape for shape:

- ``resnet50``: torchvision's ResNet-50 (v1.5: stride on the 3x3 conv), 1000 classes:
  25,557,032 parameters in 161 tensors (102 MB of float32 gradients);
- ``bert``: BERT-base (uncased, Hugging Face ``BertModel``: 30,522-token vocabulary, 512
  positions, 12 post-norm layers of width 768, pooler) = 109,482,240 parameters, plus a
  2-class head (``BertForSequenceClassification``): 109,483,778 in 201 tensors (438 MB);
- ``gpt2``: GPT-2 small (Hugging Face ``GPT2LMHeadModel``: 50,257 tokens, 1,024 positions,
  12 pre-norm layers, ``Conv1D`` weights stored (in, out), the LM head tied to the token
  embedding): 124,439,808 parameters in 148 tensors (498 MB).

Inputs are synthetic: ``sample`` makes one batch for a model (images of ``image_size`` pixels,
or ``seq_len`` tokens); the input size changes compute, never a parameter's shape.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: published parameter counts (the unit tests check the models against them)
PUBLISHED = {"resnet50": 25_557_032, "bert_trunk": 109_482_240, "gpt2": 124_439_808}


# ---- ResNet-50 ------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, stages = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ---- transformers ---------------------------------------------------------------------------
class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored (in, out), y = x @ W + b."""

    def __init__(self, nin: int, nout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nin, nout) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, n, d // n).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, n, t, h = x.shape
    return x.transpose(1, 2).reshape(b, t, n * h)


class BertLayer(nn.Module):
    """Post-norm encoder layer with BERT's tensors: query/key/value/attention-output,
    LayerNorm, intermediate (768 -> 3072), output (3072 -> 768), LayerNorm."""

    def __init__(self, d: int = 768, heads: int = 12, ff: int = 3072) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=1e-12)
        self.intermediate = nn.Linear(d, ff)
        self.output = nn.Linear(ff, d)
        self.out_norm = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(m(x), self.heads) for m in (self.query, self.key, self.value))
        a = _merge(F.scaled_dot_product_attention(q, k, v))
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    def __init__(self, vocab: int = 30522, positions: int = 512, d: int = 768,
                 layers: int = 12, classes: int = 2) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(positions, d)
        self.token_type = nn.Embedding(2, d)
        self.embed_norm = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.Sequential(*[BertLayer(d) for _ in range(layers)])
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, classes)
        for emb in (self.word, self.position, self.token_type):
            nn.init.normal_(emb.weight, std=0.02)          # BERT's initialisation

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.word(ids) + self.position.weight[:t] + self.token_type.weight[0]
        x = self.layers(self.embed_norm(x))
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class GPT2Block(nn.Module):
    def __init__(self, d: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = Conv1D(d, 4 * d)
        self.mlp_proj = Conv1D(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.heads) for t in self.c_attn(self.ln_1(x)).chunk(3, -1))
        x = x + self.c_proj(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 50257, positions: int = 1024, d: int = 768,
                 layers: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.h = nn.Sequential(*[GPT2Block(d) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        nn.init.normal_(self.wte.weight, std=0.02)      # GPT-2's initialisation
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[:ids.shape[1]]
        return F.linear(self.ln_f(self.h(x)), self.wte.weight)     # tied LM head


REAL_MODELS = {"resnet50": ResNet50, "bert": Bert, "gpt2": GPT2}


def sample(name: str, batch: int, generator: torch.Generator, image_size: int = 64,
           seq_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One synthetic (input, target) batch for a real-size model."""
    if name == "resnet50":
        return (torch.rand(batch, 3, image_size, image_size, generator=generator),
                torch.randint(0, 1000, (batch,), generator=generator))
    vocab = 30522 if name == "bert" else 50257
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    if name == "bert":
        return ids[:, :-1], torch.randint(0, 2, (batch,), generator=generator)
    return ids[:, :-1], ids[:, 1:]              # gpt2: next-token targets


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for (N, C) logits and (N,) targets or (N, T, V) and (N, T)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def count(model: nn.Module) -> int:
    """Parameters, each shared tensor once (as ``parameters()`` yields them)."""
    return sum(p.numel() for p in model.parameters())

