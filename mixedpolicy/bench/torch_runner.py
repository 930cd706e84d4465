"""PyTorch: mixedpolicy (`apply_policy` + `LossScaleOptimizer`) against `torch.autocast` + `GradScaler`."""

from __future__ import annotations

import numpy as np
import torch

import mixedpolicy as mp
from mixedpolicy.bench.worker import Trainer

LR = 0.05
_HALF = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}


def _model(weights: list, device: str) -> torch.nn.Module:
    layers = []
    for i in range(0, len(weights), 2):
        w, b = weights[i], weights[i + 1]
        linear = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


class _Torch(Trainer):
    def __init__(self, model: torch.nn.Module, device: str):
        self.model, self.device = model, device
        self._loss = None

    def _batch(self, x, y):
        return (torch.from_numpy(x).to(self.device, non_blocking=True),
                torch.from_numpy(y).long().to(self.device, non_blocking=True))

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def last_loss(self) -> float:
        return float(self._loss)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        with torch.no_grad():
            x, y = self._batch(x, y)
            return float((self.model(x).argmax(1) == y).float().mean())

    def peak_memory_bytes(self):
        return torch.cuda.max_memory_allocated() if self.device.startswith("cuda") else None


class Ours(_Torch):
    def __init__(self, policy: str, weights: list, device: str):
        super().__init__(mp.apply_policy(_model(weights, device), policy), device)
        sgd = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.opt = mp.LossScaleOptimizer(sgd) if mp.Policy(policy).needs_loss_scaling else sgd

    def step(self, x, y) -> None:
        x, y = self._batch(x, y)
        loss = torch.nn.functional.cross_entropy(self.model(x).float(), y)
        (self.opt.scale_loss(loss) if hasattr(self.opt, "scale_loss") else loss).backward()
        self.opt.step()
        self.opt.zero_grad()
        self._loss = loss.detach()

    def skipped_steps(self) -> int:
        return getattr(self.opt, "num_skipped_steps", 0)

    def loss_scale(self):
        return float(self.opt.loss_scale) if hasattr(self.opt, "loss_scale") else None


class Native(_Torch):
    def __init__(self, policy: str, weights: list, device: str):
        super().__init__(_model(weights, device), device)
        self.dtype = _HALF.get(policy)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.scaler = torch.amp.GradScaler(device.split(":")[0], enabled=policy == "mixed_float16")

    def step(self, x, y) -> None:
        x, y = self._batch(x, y)
        with torch.autocast(self.device.split(":")[0], dtype=self.dtype or torch.float32,
                            enabled=self.dtype is not None):
            out = self.model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        self._loss = loss.detach()


def environment() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # pinned: TF32 off, so float32 is float32
    torch.backends.cudnn.allow_tf32 = False
    return {"torch": torch.__version__, "tf32": False}


def trainers(policy: str, weights: list, device: str):
    environment()
    return Ours(policy, weights, device), Native(policy, weights, device)
