"""A short CUDA demo: a small CNN with synchronized batch norm trained by two replicas on one GPU, and its
state sent through a pc_pickle copy round trip.

Run: ``python examples/gpu_smoke.py [--steps 30] [--out demo.json]``. It trains
``ReplicationCallbackDataParallel(net, device_ids=[0, 0])`` (two replicas on cuda:0 whose
``SynchronizedBatchNorm2d`` layers share their batch statistics) on a fixed synthetic batch, checks that the
loss falls, then copies the model's state dict through ``pc_pickle.dumps``/``loads`` and checks it arrives
unchanged on cuda:0. Exit code 0 when both checks pass; without CUDA it says so and exits 0 having checked
nothing (``"cuda": false`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

import pc_pickle
from pc_replicate import ReplicationCallbackDataParallel
from pc_sync import SynchronizedBatchNorm2d


def make_net() -> nn.Module:
    """Two conv blocks with synchronized batch norm, then a linear classifier over 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        SynchronizedBatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        SynchronizedBatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def main(argv: list[str] | None = None) -> int:
    """Train, round-trip the state, report; returns the exit code."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    result: dict[str, object] = {"cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        print("no CUDA: torch sees no CUDA device; nothing was checked")
    else:
        torch.manual_seed(0)
        net = make_net().cuda()
        model = ReplicationCallbackDataParallel(net, device_ids=[0, 0])
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(64, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        losses = []
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        torch.cuda.synchronize()
        result["train_s"] = time.perf_counter() - start
        result["losses"] = [losses[0], losses[-1]]
        result["loss_fell"] = losses[-1] < losses[0]
        state = net.state_dict()
        back = pc_pickle.loads(pc_pickle.dumps(state))
        result["state_round_trip_exact"] = all(
            back[k].device == v.device and torch.equal(back[k], v) for k, v in state.items()
        )
        result["device"] = torch.cuda.get_device_name(0)
        print(f"cuda: {result['device']}; loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
        print(f"state dict through pc_pickle unchanged on cuda:0: {result['state_round_trip_exact']}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    ok = not result["cuda"] or (result["loss_fell"] and result["state_round_trip_exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
