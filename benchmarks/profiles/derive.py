"""Writes the per-layer device-time profiles (``resnet50.json``, ``bert.json``, ``gpt2.json``)
of the training benchmark's device-time mode, derived from each layer's FLOPs and bytes on a
stated GPU (no GPU is needed; the model runs on the ``meta`` device to find the shapes)::

    python benchmarks/profiles/derive.py          # rewrites the three files

The derivation (a roofline per layer, written into every file as its ``source``):

- GPU: NVIDIA A100-SXM4-80GB, bf16 mixed precision: 312 TFLOP/s dense tensor-core peak,
  2,039 GB/s HBM2e; a layer achieves ``MM_EFF`` of the peak FLOP rate and ``MEM_EFF`` of the
  peak bandwidth, and takes max(FLOPs / rate, bytes / bandwidth) + ``LAUNCH_S`` per kernel;
- conv / linear: 2 x MACs FLOPs forward; backward twice that (input and weight gradients), once
  for the first layer (no input gradient); bytes: input + output + weight in bf16;
- BatchNorm / LayerNorm: memory-bound, 3 passes over the activation (statistics, read, write)
  plus 2 for the element-wise op that follows it (ReLU, residual add, GELU), bf16; backward
  twice the forward bytes;
- embedding: a gather (read + write the output; the position and token-type tables, read
  as ``.weight``, the same bytes as the token table's gather); backward a scatter-add over the same bytes
  plus a pass over the table's gradient;
- attention core (QKᵀ, softmax, ·V, FlashAttention: no T x T matrix in memory): 4·B·T²·d
  FLOPs forward (half of it with the causal mask), backward 2.5x forward, counted with the
  projection that follows it (``attn_out`` / ``c_proj``);
- GPT-2's tied LM head (logits = x Wᵀ over 50,257 tokens) is a layer of its own, ``lm_head``,
  marked ``free`` (it owns no parameter: its weight is ``wte``'s), placed last in forward and
  so first in backward, as in the real model;
- other parameter-free layers (pooling, ReLU outside a norm, dropout) are not modelled;
- end-to-end check against a published figure: ResNet-50 v1.5, 1 x A100 80GB, mixed precision,
  batch 256: 2,470 img/s (NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/
  resnet50v1.5/README.md, "Training performance: NVIDIA DGX A100", pytorch-21.03 container),
  i.e. 103.6 ms per step; the file records the derived step beside it (``check``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import realmodels  # noqa: E402

PEAK_FLOPS, PEAK_BW = 312e12, 2.039e12
MM_EFF, MEM_EFF, LAUNCH_S = 0.45, 0.70, 5e-6
ELEM = 2                                                 # bytes per bf16 element
CASES = {"resnet50": dict(batch=256, image_size=224),
         "bert": dict(batch=32, seq_len=128),
         "gpt2": dict(batch=8, seq_len=1024)}
PUBLISHED_RESNET50_STEP_MS = 256 / 2470 * 1e3


def _roofline(flops: float, nbytes: float, kernels: int) -> float:
    return max(flops / (PEAK_FLOPS * MM_EFF), nbytes / (PEAK_BW * MEM_EFF)) + kernels * LAUNCH_S


def _attention_flops(module, x_shape, causal: bool) -> float:
    b, t, d = x_shape
    return 4.0 * b * t * t * d * (0.5 if causal else 1.0)


def derive(name: str) -> dict:
    case = CASES[name]
    with torch.device("meta"):
        model = realmodels.REAL_MODELS[name]()
    g = torch.Generator()
    x, _ = realmodels.sample(name, case["batch"], g, image_size=case.get("image_size", 64),
                             seq_len=case.get("seq_len", 64))
    x = x.to("meta")
    shapes: dict[str, tuple] = {}
    owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(False))]
    hooks = []
    for n, m in model.named_modules():
        def hook(mod, inp, out, n=n):
            shapes.setdefault(n, (tuple(inp[0].shape), tuple(out.shape)))
        hooks.append(m.register_forward_hook(hook))
    model(x)
    for h in hooks:
        h.remove()
    first = owners[0]
    layers, tail = [], []
    for n in owners:
        m = model.get_submodule(n)
        if n not in shapes:       # position / token-type tables read as .weight: one add
            tok = next(s for k, s in shapes.items() if isinstance(model.get_submodule(k),
                                                                   nn.Embedding))
            shapes[n] = (tok[0], tok[1])
        (inp, out) = shapes[n]
        numel = lambda s: float(torch.Size(s).numel())  # noqa: E731
        w = sum(p.numel() for p in m.parameters(False))
        if isinstance(m, nn.Conv2d):
            macs = numel(out) * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
            nbytes = ELEM * (numel(inp) + numel(out) + w)
            fwd = _roofline(2 * macs, nbytes, 1)
            bwd = _roofline(2 * macs * (1 if n == first else 2), 2 * nbytes, 1 if n == first else 2)
        elif isinstance(m, (nn.Linear, realmodels.Conv1D)):
            macs = numel(out) * inp[-1]
            nbytes = ELEM * (numel(inp) + numel(out) + w)
            fwd, bwd = _roofline(2 * macs, nbytes, 1), _roofline(4 * macs, 2 * nbytes, 2)
            parent = model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else None
            if n.endswith(("attn_out", "c_proj")) and parent is not None:
                att = _attention_flops(parent, shapes[n][0], causal=name == "gpt2")
                fwd += _roofline(att, ELEM * 4 * numel(inp), 1)
                bwd += _roofline(2.5 * att, ELEM * 8 * numel(inp), 1)
        elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            nbytes = ELEM * 5 * numel(out)
            fwd, bwd = _roofline(0, nbytes, 2), _roofline(0, 2 * nbytes, 2)
        elif isinstance(m, nn.Embedding):
            nbytes = ELEM * 2 * numel(out)
            fwd = _roofline(0, nbytes, 1)
            bwd = _roofline(0, nbytes + ELEM * w, 2)
            if name == "gpt2" and n == "wte":             # the tied LM head: logits = x Wᵀ
                b, t = inp
                macs = b * t * m.embedding_dim * m.num_embeddings
                head = ELEM * (b * t * m.num_embeddings + w)
                tail.append({"name": "lm_head", "free": True,
                             "fwd_ms": round(_roofline(2 * macs, head, 1) * 1e3, 5),
                             "bwd_ms": round(_roofline(4 * macs, 2 * head, 2) * 1e3, 5)})
        elif n == "" or w == 0:
            continue
        else:                                              # GPT2 / Bert hold only modules
            raise SystemExit(f"{name}: no rule for {n} ({type(m).__name__})")
        layers.append({"name": n, "fwd_ms": round(fwd * 1e3, 5), "bwd_ms": round(bwd * 1e3, 5)})
    layers += tail
    f = sum(l["fwd_ms"] for l in layers)
    b = sum(l["bwd_ms"] for l in layers)
    source = (f"Derived from FLOPs and bytes by benchmarks/profiles/derive.py (roofline per layer): "
              f"NVIDIA A100-SXM4-80GB, bf16, {MM_EFF:.0%} of 312 TFLOP/s and {MEM_EFF:.0%} of "
              f"2,039 GB/s, {LAUNCH_S * 1e6:.0f} us per kernel; see that file's docstring. "
              f"Not measured on a GPU.")
    prof = {"model": name, "batch": case["batch"], "input": {k: v for k, v in case.items()
                                                             if k != "batch"},
            "source": source, "F_ms": round(f, 3), "B_ms": round(b, 3), "layers": layers}
    if name == "resnet50":
        prof["check"] = (f"derived F+B {f + b:.1f} ms per step of 256 images against 103.6 ms "
                         f"published (2,470 img/s, NVIDIA DeepLearningExamples ResNet-50 v1.5, "
                         f"1 x A100 80GB, AMP): {(f + b) / PUBLISHED_RESNET50_STEP_MS:.2f}x")
    return prof


def main() -> None:
    for name in CASES:
        prof = derive(name)
        (HERE / f"{name}.json").write_text(json.dumps(prof, indent=1) + "\n")
        print(f"{name}: batch {prof['batch']}, F {prof['F_ms']:.1f} ms, B {prof['B_ms']:.1f} ms, "
              f"{len(prof['layers'])} layers" + (f"; {prof['check']}" if "check" in prof else ""))


if __name__ == "__main__":
    main()
