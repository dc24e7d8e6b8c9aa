"""PyTorch Lightning's DDPStrategy on the lightcc backend with a lightcc DDP hook (fp16), run as
``python lightning_ddp.py`` (Lightning's own launcher starts the second process), under
torchrun, or under lccrun. After two epochs every rank prints a checksum of its parameters;
DDP keeps replicas equal, so the ranks must print the same one, and the loss must fall."""
import os
import sys

import torch
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightcc.torch
from lightcc.torch import ddp_hooks


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.3
    torch.manual_seed(1)
    model = Model()
    strategy = DDPStrategy(process_group_backend="lightcc", ddp_comm_hook=ddp_hooks.fp16_hook,
                           ddp_comm_state=ddp_hooks.HookState("fp16"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    rank = trainer.global_rank
    first, last = sum(model.losses[:4]) / 4, sum(model.losses[-4:]) / 4
    checksum = sum(float(p.double().sum()) for p in model.parameters())
    assert last < first, (first, last)
    assert lightcc.torch.size() == 2 and lightcc.torch.rank() == rank
    print(f"lightning rank {rank}: checksum {checksum:.6f} loss {first:.4f} -> {last:.4f} "
          f"transport {lightcc.common.api.transport()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
